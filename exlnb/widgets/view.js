// Every exlnb widget: HTML drawn by the kernel, buttons that message it, and a report of whether the view can
// be seen (on screen, tab in front) so that live views refresh only then.
//
// When the kernel goes (restarted, shut down, its connection lost), every view says so at once and its buttons
// stop: JupyterLab's widget manager marks each model's comm dead when the kernel restarts ("comm_live_update",
// @jupyter-widgets/jupyterlab-manager), the kernel's own status says "dead", and `model.send` throws "Cannot
// send" on a comm that has gone. (Not the comm closing: a view that settles closes its own comm, after its
// output has become the static record.)
const GONE_STATUSES = new Set(["restarting", "autorestarting", "dead"]);

function render({ model, el }) {
  el.classList.add("exlnb");
  el.innerHTML =
    '<div class="exlnb-gone-note">The kernel that drew this has gone: this is its last state, nothing here ' +
    "runs any more.</div>" +
    '<div class="exlnb-body"></div><div class="exlnb-controls"></div>';
  const body = el.querySelector(".exlnb-body");
  const controls = el.querySelector(".exlnb-controls");
  const gone = () => el.classList.contains("exlnb-gone");
  const stopButtons = () => el.querySelectorAll("button").forEach((button) => { button.disabled = true; });
  const markGone = () => {
    el.classList.add("exlnb-gone");
    stopButtons();
  };
  const send = (content) => {
    if (gone()) return;
    try {
      model.send(content);
    } catch (error) {
      markGone();
    }
  };
  const draw = () => {
    body.innerHTML = model.get("html");
    if (gone()) stopButtons();
  };
  const drawControls = () => {
    controls.innerHTML = model.get("controls").map(([action, label, tip]) =>
      `<button class="exlnb-${action}" data-action="${action}" title="${tip}">${label}</button>`
    ).join("");
    if (gone()) stopButtons();
  };
  el.addEventListener("click", (event) => {
    const button = event.target.closest("button[data-action]");
    if (button) send({ ...button.dataset, type: button.dataset.action });
  });
  model.on("change:html", draw);
  model.on("change:controls", drawControls);
  model.on("comm_live_update", markGone); // the manager's only change after a view is drawn: the comm died
  draw();
  drawControls();

  const kernel = model.widget_manager && model.widget_manager.kernel;
  const onStatus = (_kernel, status) => {
    if (GONE_STATUSES.has(status)) markGone();
  };
  const onConnection = (_kernel, status) => {
    if (status === "disconnected") markGone();
  };
  if (kernel) {
    if (GONE_STATUSES.has(kernel.status)) markGone();
    kernel.statusChanged.connect(onStatus);
    kernel.connectionStatusChanged.connect(onConnection);
  }

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
    if (kernel) {
      kernel.statusChanged.disconnect(onStatus);
      kernel.connectionStatusChanged.disconnect(onConnection);
    }
    onScreen = false;
    report();
  };
}
export default { render };
