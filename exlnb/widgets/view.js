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
  const trees = model.get("trees");
  if (trees && trees.length) return initializeTrees(model, trees);
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

// The sample tree (widgets/tree.py): a `TreeChoices` model has no view either; it names tree records
// (data-exlnb-tree), which the kernel draws again as the tree grows. While its kernel runs it marks them
// .exlnb-tree-live (their action bar shows), keeps what was chosen, the folded rows, the focus and the typed text
// across drawings, and sends what is asked: a node expanded to a mass, text forced after a node, Stop. A token
// clicked, or a row reached by keyboard (its last token), is the node the tree grows after: named by its row's
// first node and its place in the row, since only a row names its nodes (a big tree's HTML stays small). Keys on a
// row, before JupyterLab's shortcuts (capture phase): ↑ ↓ the previous or next row, → unfold or go to the first row
// under it, ← fold or go to the row above it, e expand after it, f type text to force after it (Enter sends, Escape
// goes back).
function initializeTrees(model, keys) {
  const held = keys.map((key) => `[data-exlnb-tree="${key}"]`).join(", ");
  const states = new Map();
  const drawn = new WeakSet();
  let live = true;
  const treeOf = (target) => (target instanceof Element ? target.closest(held) : null);
  const stateOf = (tree) => {
    const key = tree.dataset.exlnbTree;
    if (!states.has(key)) states.set(key, { chosen: null, folded: new Set(), focused: null, text: "", typing: false });
    return states.get(key);
  };
  const rows = (tree) => [...tree.querySelectorAll("summary[data-node]")].filter((row) => row.offsetParent !== null);
  const rowOf = (tree, node) => tree.querySelector(`summary[data-node="${node}"]`);
  const say = (tree, words) => { tree.querySelector(".exlnb-tree-chosen").textContent = words; };
  const mark = (tree) => {
    const state = stateOf(tree);
    tree.classList.toggle("exlnb-tree-live", live);
    tree.querySelectorAll(".exlnb-tree-picked").forEach((el) => el.classList.remove("exlnb-tree-picked"));
    const chain = state.chosen && tree.querySelector(`.exlnb-chain[data-first="${state.chosen.first}"]`);
    const text = chain && tokenText(chain, state.chosen.offset);
    if (text !== null && text !== undefined) {
      const token = chain.children[state.chosen.offset];
      if (token && !token.matches(".exlnb-tail")) token.classList.add("exlnb-tree-picked");
      say(tree, `after ${JSON.stringify(text)} (row #${state.chosen.first}, token ${state.chosen.offset + 1})`);
    }
  };
  // a row's tokens: its first ones spans, the rest one run of text (.exlnb-tail) with each token's length
  const tailOf = (chain) => chain.querySelector(":scope > .exlnb-tail");
  const lengthsOf = (tail) => tail.dataset.lengths.split(",").map(Number);
  const tokenText = (chain, offset) => {
    const tail = tailOf(chain);
    const shaded = chain.children.length - (tail ? 1 : 0);
    if (offset < shaded) return chain.children[offset].textContent;
    if (!tail) return null;
    const lengths = lengthsOf(tail);
    const start = lengths.slice(0, offset - shaded).reduce((a, b) => a + b, 0);
    return tail.textContent.slice(start, start + lengths[offset - shaded]);
  };
  const tailOffset = (tail, event) => {
    // the token under the pointer, from the character there: a caret goes to the boundary nearest the pointer, so
    // on a character's right half it lands after it, and the character before the caret is the one clicked
    const [x, y, text] = [event.clientX, event.clientY, tail.firstChild];
    const caret = document.caretPositionFromPoint
      ? document.caretPositionFromPoint(x, y)
      : document.caretRangeFromPoint?.(x, y);
    let at = caret && (caret.offsetNode ?? caret.startContainer) === text ? (caret.offset ?? caret.startOffset) : 0;
    if (at > 0) {
      const before = document.createRange();
      before.setStart(text, at - 1);
      before.setEnd(text, at);
      const box = before.getBoundingClientRect();
      if (x >= box.left && x <= box.right && y >= box.top && y <= box.bottom) at -= 1;
    }
    let end = 0;
    const lengths = lengthsOf(tail);
    const index = lengths.findIndex((length) => (end += length) > at);
    return (index < 0 ? lengths.length - 1 : index) + tail.parentElement.children.length - 1;
  };
  const lastOf = (row) => {
    const chain = row.querySelector(".exlnb-chain");
    return { first: chain.dataset.first, offset: Number(chain.dataset.count) - 1 };
  };
  const focusRow = (tree, row) => {
    if (!row) return;
    tree.querySelectorAll("summary[data-node]").forEach((other) => { other.tabIndex = -1; });
    row.tabIndex = 0;
    row.focus({ preventScroll: false });
    const state = stateOf(tree);
    state.focused = row.dataset.node;
    state.chosen = lastOf(row);
    mark(tree);
  };
  const restore = (tree) => {
    const state = stateOf(tree);
    state.folded.forEach((node) => { const row = rowOf(tree, node); if (row) row.parentElement.open = false; });
    tree.querySelector(".exlnb-tree-text").value = state.text;
    if (state.mass) tree.querySelector(".exlnb-tree-mass").value = state.mass;
    const summaries = [...tree.querySelectorAll("summary[data-node]")];
    const current = (state.focused !== null && rowOf(tree, state.focused)) || summaries[0];
    summaries.forEach((row) => { row.tabIndex = row === current ? 0 : -1; });
    const away = !document.activeElement || document.activeElement === document.body;
    if (state.typing && away) tree.querySelector(".exlnb-tree-text").focus({ preventScroll: true });
    else if (state.focused !== null && away) rowOf(tree, state.focused)?.focus({ preventScroll: true });
    mark(tree);
  };
  const send = (tree, content) => {
    if (!live) return;
    try {
      model.send({ ...content, tree: tree.dataset.exlnbTree });
    } catch (error) {
      goes();
    }
  };
  const act = (tree, kind) => {
    const state = stateOf(tree);
    if (kind === "stop") return send(tree, { type: "stop" });
    if (state.chosen === null) return say(tree, "choose a token first: click it, or reach its row with the arrow keys");
    const mass = Number(tree.querySelector(".exlnb-tree-mass").value);
    const node = { node: Number(state.chosen.first), offset: state.chosen.offset };
    if (kind === "expand") send(tree, { type: "expand", ...node, mass });
    if (kind === "force" && state.text) {
      send(tree, { type: "force", ...node, text: state.text });
      state.text = "";
      tree.querySelector(".exlnb-tree-text").value = "";
    }
  };
  const goes = () => {
    live = false;
    document.querySelectorAll(held).forEach((tree) => tree.classList.remove("exlnb-tree-live"));
  };
  const onClick = (event) => {
    const tree = treeOf(event.target);
    if (!live || !tree) return;
    const button = event.target.closest("button[data-act]");
    const token = event.target.closest(".exlnb-chain > span");
    if (button) act(tree, button.dataset.act);
    else if (token) {
      event.preventDefault(); // a token is chosen, its row not folded
      const tail = token.matches(".exlnb-tail");
      const offset = tail ? tailOffset(token, event) : [...token.parentElement.children].indexOf(token);
      stateOf(tree).chosen = { first: token.parentElement.dataset.first, offset };
      mark(tree);
    }
  };
  const onKey = (event) => {
    const tree = treeOf(event.target);
    if (!live || !tree) return;
    const here = event.target;
    const state = stateOf(tree);
    if (here.matches("input")) {
      if (event.key === "Enter") act(tree, here.matches(".exlnb-tree-text") ? "force" : "expand");
      else if (event.key === "Escape" && state.focused !== null) rowOf(tree, state.focused)?.focus();
      event.stopPropagation(); // typing here is not a notebook shortcut
      return;
    }
    if (!here.matches("summary[data-node]")) return;
    const all = rows(tree);
    const at = all.indexOf(here);
    const details = here.parentElement;
    const parentRow = details.parentElement.closest("details")?.querySelector(":scope > summary");
    const moves = {
      ArrowDown: () => focusRow(tree, all[at + 1]),
      ArrowUp: () => focusRow(tree, all[at - 1]),
      ArrowRight: () => (details.open ? focusRow(tree, details.querySelector("ul summary")) : (details.open = true)),
      ArrowLeft: () => (details.open && details.querySelector("ul") ? (details.open = false) : focusRow(tree, parentRow)),
      Home: () => focusRow(tree, all[0]),
      End: () => focusRow(tree, all[all.length - 1]),
      e: () => { state.chosen = lastOf(here); mark(tree); act(tree, "expand"); },
      f: () => { state.chosen = lastOf(here); mark(tree); tree.querySelector(".exlnb-tree-text").focus(); },
    };
    if (moves[event.key]) {
      moves[event.key]();
      event.preventDefault();
    }
    if (moves[event.key] || event.key === "Enter" || event.key === " ") event.stopPropagation();
  };
  const onToggle = (event) => {
    const tree = treeOf(event.target);
    const row = tree && event.target.querySelector(":scope > summary[data-node]");
    if (!row) return;
    const folded = stateOf(tree).folded;
    if (event.target.open) folded.delete(row.dataset.node);
    else folded.add(row.dataset.node);
  };
  const onInput = (event) => {
    const tree = treeOf(event.target);
    if (tree && event.target.matches(".exlnb-tree-text")) stateOf(tree).text = event.target.value;
    if (tree && event.target.matches(".exlnb-tree-mass")) stateOf(tree).mass = event.target.value;
  };
  const onFocus = (event) => {
    const tree = treeOf(event.target);
    if (!tree) return;
    const state = stateOf(tree);
    state.typing = event.target.matches(".exlnb-tree-text");
    if (event.target.matches("summary[data-node]")) state.focused = event.target.dataset.node;
  };
  const observer = new MutationObserver(() => {
    document.querySelectorAll(held).forEach((tree) => {
      if (!drawn.has(tree)) {
        drawn.add(tree);
        restore(tree);
      }
    });
  });
  observer.observe(document.body, { childList: true, subtree: true });
  document.querySelectorAll(held).forEach((tree) => { drawn.add(tree); restore(tree); });
  const stopWatching = whenKernelGoes(model, goes);
  document.addEventListener("click", onClick, true);
  document.addEventListener("keydown", onKey, true);
  document.addEventListener("toggle", onToggle, true);
  document.addEventListener("input", onInput, true);
  document.addEventListener("focusin", onFocus);
  return () => {
    goes();
    stopWatching();
    observer.disconnect();
    document.removeEventListener("click", onClick, true);
    document.removeEventListener("keydown", onKey, true);
    document.removeEventListener("toggle", onToggle, true);
    document.removeEventListener("input", onInput, true);
    document.removeEventListener("focusin", onFocus);
  };
}
export default { initialize, render };
