// "Core path only": fold every deep-dive section (its heading stays), remembered across pages.
document.addEventListener("DOMContentLoaded", () => {
  const key = "course-core-only";
  const apply = (on) => {
    document.body.classList.toggle("core-only", on);
    document.querySelectorAll(".core-only-switch").forEach((box) => { box.checked = on; });
  };
  let saved = false;
  try { saved = window.localStorage.getItem(key) === "1"; } catch (error) { /* storage may be disabled */ }
  apply(saved);
  document.querySelectorAll(".core-only-switch").forEach((box) => box.addEventListener("change", () => {
    apply(box.checked);
    try { window.localStorage.setItem(key, box.checked ? "1" : "0"); } catch (error) { /* ignore */ }
  }));
});
