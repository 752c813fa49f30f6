// Every exlnb widget: HTML drawn by the kernel, buttons that message it, and a report of whether the view can
// be seen (on screen, tab in front) so that live views refresh only then. After a kernel restart the comm is
// gone and `model.send` throws "Cannot send": the view then says so instead of throwing on every event.
function render({ model, el }) {
  el.classList.add("exlnb");
  el.innerHTML =
    '<div class="exlnb-gone-note">The kernel that drew this has gone: its last state is shown.</div>' +
    '<div class="exlnb-body"></div><div class="exlnb-controls"></div>';
  const body = el.querySelector(".exlnb-body");
  const controls = el.querySelector(".exlnb-controls");
  const send = (content) => {
    if (el.classList.contains("exlnb-gone")) return;
    try {
      model.send(content);
    } catch (error) {
      el.classList.add("exlnb-gone");
    }
  };
  const draw = () => {
    body.innerHTML = model.get("html");
  };
  const drawControls = () => {
    controls.innerHTML = model.get("controls").map(([action, label, tip]) =>
      `<button class="exlnb-${action}" data-action="${action}" title="${tip}">${label}</button>`
    ).join("");
  };
  el.addEventListener("click", (event) => {
    const button = event.target.closest("button[data-action]");
    if (button) send({ ...button.dataset, type: button.dataset.action });
  });
  model.on("change:html", draw);
  model.on("change:controls", drawControls);
  draw();
  drawControls();

  const view = Math.random().toString(36).slice(2);
  let reported = false;
  let onScreen = false;
  const report = () => {
    const visible = onScreen && !document.hidden;
    if (visible !== reported) {
      reported = visible;
      send({ type: "visible", view, visible });
    }
  };
  const observer = new IntersectionObserver((entries) => {
    onScreen = entries.some((e) => e.isIntersecting);
    report();
  });
  observer.observe(el);
  document.addEventListener("visibilitychange", report);
  return () => {
    observer.disconnect();
    document.removeEventListener("visibilitychange", report);
    onScreen = false;
    report();
  };
}
export default { render };
