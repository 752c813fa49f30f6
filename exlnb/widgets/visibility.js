// Tells the kernel whether this view can be seen (on screen, tab in front), so it refreshes only then.
function watchVisibility(model, el) {
  const view = Math.random().toString(36).slice(2);
  let reported = false;
  let onScreen = false;
  const report = () => {
    const visible = onScreen && !document.hidden;
    if (visible !== reported) {
      reported = visible;
      model.send({ type: "visible", view, visible });
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
