// zephon ui: refreshes the page's content in place every data-refresh seconds. The charts are
// SVG drawn by the server inside the page, so a refresh swaps them in with the rest.
"use strict";

async function refresh() {
  try {
    const response = await fetch(location.href, { headers: { accept: "text/html" } });
    // a form field being edited holds the swap back, so a filter being typed is not lost
    const editing = document.activeElement && document.activeElement.name;
    if (response.ok && !editing) {
      const page = new DOMParser().parseFromString(await response.text(), "text/html");
      const fresh = page.getElementById("content");
      document.getElementById("content").replaceChildren(...fresh.childNodes);
      const stamp = document.getElementById("refreshed");
      if (stamp) stamp.textContent = `refreshed ${new Date().toLocaleTimeString()}`;
    }
  } finally {
    schedule();
  }
}

function schedule() {
  const seconds = Number(document.body.dataset.refresh || 0);
  if (seconds > 0) setTimeout(refresh, seconds * 1000);
}

window.addEventListener("DOMContentLoaded", schedule);
