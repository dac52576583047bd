// The configuration panel: model, dtype, KV-cache blocks and every serve flag in effect.

import { api } from "./api.js";
import { el } from "./format.js";

function row(name, value) {
  return el("tr", {}, el("th", { text: name }), el("td", { text: value == null ? "\u2013" : String(value) }));
}

export async function loadConfig() {
  const response = await api("/ui/config");
  if (!response.ok) throw new Error("HTTP " + response.status);
  const c = await response.json();
  const kv = c.kv_cache || {};
  const summary = el("table", { class: "kv", "data-testid": "config-summary" },
    row("Model", c.served_model_names.join(", ")),
    row("Path", c.model),
    row("dtype", c.dtype),
    row("Device", c.device),
    row("Max model length", c.max_model_len),
    row("KV-cache blocks", kv.num_blocks == null ? null : `${kv.num_blocks} \u00d7 ${kv.block_size} tokens = ${kv.num_tokens} tokens`),
    row("Prefix caching", kv.prefix_caching ? "on" : "off"),
    row("Version", c.version));
  document.getElementById("config-summary").replaceChildren(summary);

  const flags = [...c.flags].sort((a, b) => Number(b.changed) - Number(a.changed));
  const table = document.getElementById("config-flags");
  table.replaceChildren(el("tr", {}, el("th", { text: "flag" }), el("th", { text: "value" }), el("th", { text: "default" })),
    ...flags.map((f) => {
      const tr = el("tr", { class: f.changed ? "changed" : "" },
        el("td", { text: f.flag }), el("td", { text: JSON.stringify(f.value) }), el("td", { text: JSON.stringify(f.default) }));
      return tr;
    }));
  return c;
}
