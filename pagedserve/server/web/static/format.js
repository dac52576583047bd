// Number formats shared by the gauges, chart axes and the chat's answer statistics.

const DASH = "\u2013";

export const fmt = {
  int: (v) => (v == null ? DASH : String(Math.round(v))),
  rate: (v) => (v == null ? DASH : v >= 100 ? v.toFixed(0) : v.toFixed(1)),
  pct: (v) => (v == null ? DASH : (100 * v).toFixed(1) + " %"),
  // a duration given in seconds: "850 ms", "4.2 ms", "1.25 s"
  seconds: (v) => (v == null ? DASH : v >= 1 ? v.toFixed(2) + " s" : (1000 * v).toFixed(v >= 0.01 ? 0 : 1) + " ms"),
};

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}
