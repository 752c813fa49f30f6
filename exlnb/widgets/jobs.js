// The job table: pending and active jobs, a Cancel button each and one for all.
function render({ model, el }) {
  el.classList.add("exlnb-jobs");
  const draw = () => {
    const rows = model.get("rows");
    const header = model.get("columns").map((c) => `<th>${c}</th>`).join("");
    const body = rows.map(({ job_id, cells }) =>
      `<tr>${cells.map((c) => `<td>${c}</td>`).join("")}` +
      `<td><button class="exlnb-cancel" data-job="${job_id}">Cancel</button></td></tr>`
    ).join("");
    el.innerHTML =
      `<div class="exlnb-summary">${model.get("summary")}</div>` +
      (rows.length ? `<table><thead><tr>${header}<th></th></tr></thead><tbody>${body}</tbody></table>` : "") +
      `<button class="exlnb-cancel-all" ${rows.length ? "" : "disabled"}>Cancel all</button>`;
    for (const button of el.querySelectorAll(".exlnb-cancel")) {
      button.onclick = () => model.send({ type: "cancel", job_id: Number(button.dataset.job) });
    }
    el.querySelector(".exlnb-cancel-all").onclick = () => model.send({ type: "cancel_all" });
  };
  for (const name of ["rows", "summary"]) model.on(`change:${name}`, draw);
  draw();
  return watchVisibility(model, el);
}
export default { render };
