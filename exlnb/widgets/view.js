// Every exlnb widget: HTML drawn by the kernel, buttons that message it, and a report of whether the view can
// be seen (on screen, tab in front) so that live views refresh only then.
//
// When the kernel goes (restarted, shut down, its connection lost), every view says so at once and its buttons
// stop: JupyterLab's widget manager marks each model's comm dead when the kernel restarts ("comm_live_update",
// @jupyter-widgets/jupyterlab-manager), the kernel's own status says "dead", and `model.send` throws "Cannot
// send" on a comm that has gone. (Not the comm closing: a view that settles closes its own comm, after its
// output has become the static record.)
const GONE_STATUSES = new Set(["restarting", "autorestarting", "dead"]);

// Call `gone` once the kernel behind `model` has gone; returns what stops listening.
function whenKernelGoes(model, gone) {
  model.on("comm_live_update", gone); // the manager's only change after a model is made: the comm died
  const kernel = model.widget_manager && model.widget_manager.kernel;
  if (!kernel) return () => {};
  const onStatus = (_kernel, status) => {
    if (GONE_STATUSES.has(status)) gone();
  };
  const onConnection = (_kernel, status) => {
    if (status === "disconnected") gone();
  };
  if (GONE_STATUSES.has(kernel.status)) gone();
  kernel.statusChanged.connect(onStatus);
  kernel.connectionStatusChanged.connect(onConnection);
  return () => {
    kernel.statusChanged.disconnect(onStatus);
    kernel.connectionStatusChanged.disconnect(onConnection);
  };
}

const GONE_NOTE = "The kernel that drew this has gone: this is its last state, nothing here runs any more.";
const WIDGET_MIME = "application/vnd.jupyter.widget-view+json";

// A kernel that restarts or dies never replaces its views' outputs with their records (widgets/record.py), and a
// saved notebook reopened without it reads "Error displaying widget: model not found" where they were. So once
// the kernel has gone, a view writes the state it holds into its output in the notebook, as static HTML with the
// stylesheet and as text, as the kernel's record would have: the notebook's widget manager holds its document
// (@jupyter-widgets/jupyterlab-manager 5, `WidgetManager.context`), whose cells hold the outputs, each naming its
// widget by model id (`model_key`). The output then renders as that HTML, and the view goes.
function recordInNotebook(model, body) {
  const notebook = model.widget_manager && model.widget_manager.context && model.widget_manager.context.model;
  const key = model.get("model_key");
  if (!notebook || !notebook.cells || !key) return;
  const record = {
    output_type: "display_data",
    metadata: {},
    data: {
      "text/html": `<style>${model.get("_css")}</style><div class="exlnb exlnb-record exlnb-gone">` +
        `<div class="exlnb-gone-note">${GONE_NOTE}</div>${body.innerHTML}</div>`, // its buttons disabled
      "text/plain": `${GONE_NOTE}\n${body.innerText}`,
    },
  };
  for (let c = 0; c < notebook.cells.length; c++) {
    const outputs = notebook.cells.get(c).outputs; // code cells only
    for (let i = 0; outputs && i < outputs.length; i++) {
      const shown = outputs.get(i).data[WIDGET_MIME];
      if (shown && shown.model_id === key) outputs.set(i, record);
    }
  }
}

function render({ model, el }) {
  el.classList.add("exlnb");
  el.innerHTML =
    `<div class="exlnb-gone-note">${GONE_NOTE}</div>` +
    '<div class="exlnb-body"></div><div class="exlnb-controls"></div>';
  const body = el.querySelector(".exlnb-body");
  const controls = el.querySelector(".exlnb-controls");
  const gone = () => el.classList.contains("exlnb-gone");
  const stopButtons = () => el.querySelectorAll("button").forEach((button) => { button.disabled = true; });
  const markGone = () => {
    if (gone()) return;
    el.classList.add("exlnb-gone");
    stopButtons();
    setTimeout(() => recordInNotebook(model, body)); // after the signal that told it: the output's view then goes
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
  draw();
  drawControls();
  const stopWatching = whenKernelGoes(model, markGone);

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
    stopWatching();
    onScreen = false;
    report();
  };
}

// Branching from a token view (widgets/branches.py): a `BranchChoices` model has no view; it holds answers by the
// key their token views carry (data-exlnb-answer), views that are static records by then, which JupyterLab may
// draw again at any time. So it listens on the document: while its kernel runs, choosing an alternative in one
// of them (a click, or Enter; ↓ and ↑ from a token walk its alternatives, Escape goes back) messages the kernel,
// and a view the pointer or focus comes to is marked .exlnb-branching, which its popover says; once the kernel
// has gone, nothing is marked and nothing is sent. Keys are handled in the capture phase, before JupyterLab's
// own shortcuts (on the document, bubbling): ↓ would otherwise select the next cell.
function initialize({ model }) {
  const answers = model.get("answers");
  if (!answers || !answers.length) return undefined; // every other exlnb widget
  const held = answers.map((key) => `[data-exlnb-answer="${key}"]`).join(", ");
  let live = true;
  const viewOf = (target) => (target instanceof Element ? target.closest(held) : null);
  const goes = () => {
    live = false;
    document.querySelectorAll(held).forEach((view) => view.classList.remove("exlnb-branching"));
  };
  const mark = (event) => {
    const view = viewOf(event.target);
    if (view) view.classList.toggle("exlnb-branching", live);
  };
  const choose = (alternative) => {
    const view = viewOf(alternative);
    if (!live || !view) return;
    try {
      model.send({ type: "branch", answer: view.dataset.exlnbAnswer, at: Number(alternative.dataset.at),
                   token: Number(alternative.dataset.token) });
    } catch (error) {
      goes();
    }
  };
  const onClick = (event) => {
    const alternative = event.target instanceof Element && event.target.closest(".exlnb-alt");
    if (alternative) choose(alternative);
  };
  const onKey = (event) => {
    const here = event.target;
    if (!live || !viewOf(here)) return;
    const chip = here.closest(".exlnb-chip");
    const alternatives = chip ? [...chip.querySelectorAll(".exlnb-alt")] : [];
    const step = { ArrowDown: 1, ArrowUp: -1 }[event.key];
    if (event.key === "Enter" && here.matches(".exlnb-alt")) {
      choose(here);
    } else if (step && alternatives.length) {
      const at = alternatives.indexOf(here); // -1 on the token itself
      alternatives[Math.min(Math.max(at + step, 0), alternatives.length - 1)].focus();
    } else if (event.key === "Escape" && here.matches(".exlnb-alt")) {
      chip.focus();
    } else {
      return;
    }
    event.preventDefault();
    event.stopPropagation();
  };
  const stopWatching = whenKernelGoes(model, goes);
  document.addEventListener("mouseover", mark);
  document.addEventListener("focusin", mark);
  document.addEventListener("click", onClick);
  document.addEventListener("keydown", onKey, true);
  return () => {
    goes();
    stopWatching();
    document.removeEventListener("mouseover", mark);
    document.removeEventListener("focusin", mark);
    document.removeEventListener("click", onClick);
    document.removeEventListener("keydown", onKey, true);
  };
}
export default { initialize, render };
