// The cache inspector: one square per page, coloured by the job that owns it.
function render({ model, el }) {
  el.classList.add("exlnb-cache");
  const draw = () => {
    const grid = model.get("cells").map(([background, title, kind]) =>
      `<div class="exlnb-page exlnb-${kind}" style="background:${background}" title="${title}"></div>`
    ).join("");
    el.innerHTML =
      `<div class="exlnb-summary">${model.get("summary")}</div>` +
      `<div class="exlnb-grid">${grid}</div>` +
      `<div class="exlnb-legend">${model.get("legend")}</div>`;
  };
  for (const name of ["cells", "summary", "legend"]) model.on(`change:${name}`, draw);
  draw();
  return watchVisibility(model, el);
}
export default { render };
