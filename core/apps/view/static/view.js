// tempering view: metric curves, a rollouts browser and the recipe of one run folder.
// Plain JavaScript with no dependencies (the page must work offline). Every piece of run data
// reaches the page through textContent, never as HTML: transcripts are model output.
"use strict";

const $ = (sel, root = document) => root.querySelector(sel);
const SVG = "http://www.w3.org/2000/svg";
// Shown first, in this order; a stage's other metrics sit under "more metrics".
const PRIORITY = ["reward/mean", "accuracy", "eval/accuracy", "eval/reward", "loss", "nll", "kl_ref",
  "reward/failed", "completion/mean_len", "env/turns_mean", "offpolicy/staleness_mean"];
const HIDDEN = new Set(["step", "time", "step_time"]);
const PAGE = 20;

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) if (c != null) node.append(c);
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

async function getJSON(url) {
  const res = await fetch(url);
  const body = await res.json();
  if (!res.ok) throw new Error(body.error || res.statusText);
  return body;
}

function fmt(x) {
  if (typeof x !== "number") return String(x);
  if (Number.isInteger(x)) return String(x);
  const a = Math.abs(x);
  return a !== 0 && (a < 1e-3 || a >= 1e5) ? x.toExponential(1) : String(Number(x.toPrecision(4)));
}

// ------------------------------------------------------------------ tabs
function showTab(name) {
  const changed = !$(`#tab-${name}`).classList.contains("active");
  for (const a of document.querySelectorAll("#tabs a")) a.classList.toggle("active", a.dataset.tab === name);
  for (const s of document.querySelectorAll(".tab")) s.classList.toggle("active", s.id === `tab-${name}`);
  if (changed) window.scrollTo(0, 0);
}

function route() {
  const [name, query] = (location.hash.slice(1) || "metrics").split("?");
  showTab(["metrics", "rollouts", "plots", "recipe"].includes(name) ? name : "metrics");
  if (name === "plots") loadPlots();
  if (name === "rollouts") {
    setFilters(new URLSearchParams(query || ""));
    loadRollouts();
  }
}

// ------------------------------------------------------------------ metrics
function seriesByStage(rows, stages) {
  const byStage = new Map(stages.map((s) => [s, new Map()]));
  for (const row of rows) {
    const stage = String(row.stage ?? "");
    if (!byStage.has(stage)) byStage.set(stage, new Map());
    const metrics = byStage.get(stage);
    for (const [key, value] of Object.entries(row)) {
      if (HIDDEN.has(key) || key.startsWith("time/") || typeof value !== "number" || !Number.isFinite(value)) continue;
      if (!metrics.has(key)) metrics.set(key, []);
      metrics.get(key).push([row.step, value]);
    }
  }
  return byStage;
}

function ordered(keys) {
  const first = PRIORITY.filter((k) => keys.includes(k));
  const rest = keys.filter((k) => !PRIORITY.includes(k)).sort();
  return [first, rest];
}

function chart(stage, name, points) {
  const W = 300, H = 130, L = 52, R = 8, T = 8, B = 20;
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
  const px = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const py = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img", "aria-label": `${stage} ${name}` });
  root.append(svg("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }));
  root.append(svg("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }));
  for (const [y, anchor] of [[y1, T + 8], [y0, H - B]]) {
    const t = svg("text", { class: "tick", x: L - 4, y: anchor, "text-anchor": "end" });
    t.textContent = Number.isInteger(y) || Math.abs(y) < 1e-3 ? fmt(y) : String(Number(y.toPrecision(3)));
    root.append(t);
  }
  for (const [x, a] of [[x0, "start"], [x1, "end"]]) {
    const t = svg("text", { class: "tick", x: px(x), y: H - 6, "text-anchor": a });
    t.textContent = fmt(x);
    root.append(t);
  }
  const d = points.map((p, i) => `${i ? "L" : "M"}${px(p[0]).toFixed(1)},${py(p[1]).toFixed(1)}`).join(" ");
  root.append(svg("path", { class: "series", d }));
  if (points.length <= 60) for (const [x, y] of points) root.append(svg("circle", { class: "dot", cx: px(x), cy: py(y), r: 2.2 }));
  const cursor = svg("line", { class: "cursor", y1: T, y2: H - B, visibility: "hidden" });
  root.append(cursor);

  const last = points[points.length - 1];
  const tip = el("div", { class: "tooltip" });
  const fig = el("figure", { class: "chart", "data-stage": stage, "data-metric": name },
    el("figcaption", {}, el("b", { text: name }), el("span", { class: "muted", text: `${fmt(last[1])} @ ${last[0]}` })),
    root, tip);
  const nearest = (evt) => {
    const box = root.getBoundingClientRect();
    const x = x0 + ((evt.clientX - box.left) / box.width * W - L) / (W - L - R) * (x1 - x0);
    return points.reduce((best, p) => (Math.abs(p[0] - x) < Math.abs(best[0] - x) ? p : best), points[0]);
  };
  root.addEventListener("mousemove", (evt) => {
    const p = nearest(evt);
    cursor.setAttribute("x1", px(p[0])); cursor.setAttribute("x2", px(p[0]));
    cursor.setAttribute("visibility", "visible");
    tip.textContent = `step ${p[0]}: ${fmt(p[1])}`;
    tip.style.display = "block";
  });
  root.addEventListener("mouseleave", () => { cursor.setAttribute("visibility", "hidden"); tip.style.display = "none"; });
  root.addEventListener("click", (evt) => {
    const p = nearest(evt);
    location.hash = `rollouts?stage=${encodeURIComponent(stage)}&step_min=${p[0]}&step_max=${p[0]}`;
  });
  return fig;
}

function renderMetrics(rows, stages) {
  const host = $("#stages");
  host.replaceChildren();
  if (!rows.length) { host.append(el("p", { class: "muted", text: "metrics.jsonl has no rows yet." })); return; }
  for (const [stage, metrics] of seriesByStage(rows, stages)) {
    if (!metrics.size) continue;
    const steps = [...metrics.values()].flat().map((p) => p[0]);
    const [first, rest] = ordered([...metrics.keys()]);
    const shown = first.length ? first : rest.slice(0, 4);
    const box = el("div", { class: "stage", "data-stage": stage },
      el("h2", {}, stage || "run", el("span", { class: "muted", text: `steps ${Math.min(...steps)}-${Math.max(...steps)}` })));
    const grid = el("div", { class: "charts" });
    for (const key of shown) grid.append(chart(stage, key, metrics.get(key)));
    box.append(grid);
    const others = rest.filter((k) => !shown.includes(k));
    if (others.length) {
      const more = el("details", { class: "more" }, el("summary", { text: `${others.length} more metrics` }));
      more.addEventListener("toggle", () => {
        if (!more.open || more.querySelector(".charts")) return;
        const g = el("div", { class: "charts" });
        for (const key of others) g.append(chart(stage, key, metrics.get(key)));
        more.append(g);
      }, { once: false });
      box.append(more);
    }
    host.append(box);
  }
}

// ------------------------------------------------------------------ rollouts
let offset = 0;

function filterParams() {
  const params = new URLSearchParams();
  for (const field of $("#filters").elements) {
    if (field.name && field.value && !(field.name === "failed" && field.value === "any")) params.set(field.name, field.value);
  }
  return params;
}

function setFilters(params) {
  for (const field of $("#filters").elements) {
    if (!field.name) continue;
    const value = params.get(field.name) ?? (field.name === "failed" ? "any" : "");
    if (field.tagName === "SELECT" && value && ![...field.options].some((o) => o.value === value)) field.append(el("option", { value, text: value }));
    field.value = value;
  }
  offset = Number(params.get("offset") || 0);
}

function fillSelect(select, values) {
  const keep = select.value;
  const fixed = [...select.options].filter((o) => o.value === "" || o.value === "any");
  select.replaceChildren(...fixed, ...values.map((v) => el("option", { value: v, text: v })));
  select.value = keep;
}

function callText(call) {
  const fn = call.function || call;
  let args = fn.arguments;
  try { args = typeof args === "string" ? JSON.parse(args || "{}") : args || {}; } catch { return `${fn.name}(${fn.arguments})`; }
  return `${fn.name}(${Object.entries(args).map(([k, v]) => `${k}=${JSON.stringify(v)}`).join(", ")})`;
}

function message(m) {
  const role = m.role || "?";
  const label = role === "tool" && m.name ? `tool · ${m.name}` : role;
  const node = el("div", { class: `msg ${role}`, "data-role": role }, el("span", { class: "role", text: label }));
  if (m.content) node.append(el("pre", { class: "content", text: typeof m.content === "string" ? m.content : JSON.stringify(m.content) }));
  for (const call of m.tool_calls || []) {
    node.append(el("div", { class: "tool-call" }, el("code", { text: callText(call) }), call.id ? el("span", { class: "call-id", text: call.id }) : null));
  }
  return node;
}

function rolloutCard(r) {
  const good = typeof r.reward === "number" && r.reward > 0 && !r.failed;
  const card = el("article", { class: `rollout${r.failed ? " failed" : good ? " good" : ""}`, "data-step": r.step, "data-kind": r.kind });
  const head = el("header", {},
    el("span", { class: "tag", text: r.stage }),
    el("span", { text: `step ${r.step}` }),
    el("span", { class: "tag", text: r.kind }),
    el("span", { class: "muted", text: `group ${r.group} · #${r.sample}` }),
    el("span", { class: "tag reward", text: `reward ${fmt(r.reward)}` }));
  if (typeof r.advantage === "number") head.append(el("span", { class: `tag ${r.advantage > 0 ? "pos" : r.advantage < 0 ? "neg" : ""}`, text: `adv ${r.advantage > 0 ? "+" : ""}${fmt(r.advantage)}` }));
  head.append(el("span", { class: "muted", text: `stop ${r.stop} · ${r.turns} turn${r.turns === 1 ? "" : "s"} · ${r.tokens} tokens · v${r.policy_version}${r.staleness ? ` (stale ${r.staleness})` : ""}` }));
  if (r.failed) head.append(el("span", { class: "tag failure", text: r.failure || "failed" }));
  if (r.masked) head.append(el("span", { class: "tag", text: "masked" }));
  card.append(head);
  const body = el("div", { class: "transcript" });
  if (r.messages) for (const m of r.messages) body.append(message(m));
  else {
    body.append(message({ role: "user", content: r.prompt ?? "" }));
    body.append(message({ role: "assistant", content: r.completion }));
  }
  card.append(body);
  if (r.error) card.append(el("div", { class: "error" }, el("pre", { text: r.error })));
  if (r.feedback) card.append(el("div", { class: "msg feedback", "data-role": "feedback" }, el("span", { class: "role", text: "feedback" }), el("pre", { text: r.feedback })));
  const extra = { example: r.example, reward_info: r.reward_info };
  card.append(el("details", {}, el("summary", { text: "example and reward parts" }), el("pre", { text: JSON.stringify(extra, null, 2) })));
  return card;
}

async function loadRollouts() {
  const params = filterParams();
  params.set("offset", offset);
  params.set("limit", PAGE);
  const list = $("#rollout-list");
  let page;
  try { page = await getJSON(`/api/rollouts?${params}`); } catch (err) {
    list.replaceChildren(el("div", { class: "error", text: String(err.message || err) }));
    return;
  }
  fillSelect($("#filters [name=stage]"), page.facets.stages);
  fillSelect($("#filters [name=cause]"), page.facets.causes);
  const range = page.facets.steps.length ? `, steps ${page.facets.steps[0]}-${page.facets.steps[1]}` : "";
  $("#rollout-summary").textContent = `${page.total} matching sample${page.total === 1 ? "" : "s"}${range}`;
  list.replaceChildren(...page.records.map(rolloutCard));
  if (!page.records.length) list.append(el("p", { class: "muted", text: "No rollouts match (rollouts.jsonl is written by RL stages and evaluations)." }));
  $("#page-info").textContent = page.total ? `${offset + 1}-${Math.min(offset + PAGE, page.total)} of ${page.total}` : "";
  $("#prev").disabled = offset === 0;
  $("#next").disabled = offset + PAGE >= page.total;
}

function applyFilters(newOffset = 0) {
  offset = newOffset;
  const params = filterParams();
  if (offset) params.set("offset", offset);
  const target = `#rollouts?${params}`;
  if (location.hash === target) loadRollouts(); else location.hash = target;
}

// ------------------------------------------------------------------ recipe
function yaml(value, indent = "") {
  if (Array.isArray(value)) {
    if (!value.length) return "[]";
    return value.map((v) => `\n${indent}- ${yaml(v, indent + "  ").replace(/^\n\s*/, "")}`).join("");
  }
  if (value && typeof value === "object") {
    const entries = Object.entries(value);
    if (!entries.length) return "{}";
    return entries.map(([k, v]) => `\n${indent}${k}: ${yaml(v, indent + "  ")}`.replace(/: \n/, ":\n")).join("");
  }
  return value === null ? "null" : typeof value === "string" && (/^[\w./:-]+$/.test(value) === false) ? JSON.stringify(value) : String(value);
}

function renderRecipe(run) {
  const body = $("#components tbody");
  body.replaceChildren(...Object.entries(run.components).map(([key, source]) => {
    const [kind, ...name] = key.split(":");
    return el("tr", {}, el("td", { text: kind }), el("td", { text: name.join(":") }), el("td", { text: source }));
  }));
  $("#recipe").textContent = yaml(run.recipe).trimStart() || "(run.json not written yet)";
  $("#progress").textContent = JSON.stringify(run.progress, null, 2);
}

// ------------------------------------------------------------------ plots
async function loadPlots() {
  const paths = await getJSON("/api/plots");
  const host = $("#plots");
  if (!paths.length) { host.replaceChildren(el("p", { class: "muted", text: "The run has drawn no plots yet." })); return; }
  const stamp = Date.now();  // a live run redraws its files under the same names
  host.replaceChildren(...paths.map((path) => el("figure", { class: "plot" },
    el("img", { src: `/plots/${path.split("/").map(encodeURIComponent).join("/")}?t=${stamp}`, alt: path }),
    el("figcaption", { text: path }))));
}

// ------------------------------------------------------------------ start
async function main() {
  const [run, rows] = await Promise.all([getJSON("/api/run"), getJSON("/api/metrics")]);
  document.title = `${run.name} · tempering view`;
  $("#run-name").textContent = run.name;
  const done = (run.progress.completed || []).length;
  $("#run-meta").textContent = `${run.folder} · ${run.stages.length} stage${run.stages.length === 1 ? "" : "s"}, ${done} finished · global step ${run.progress.global_step ?? 0}${run.tempering ? ` · tempering ${run.tempering}` : ""}`;
  renderMetrics(rows, run.stages);
  renderRecipe(run);
  $("#filters").addEventListener("submit", (evt) => { evt.preventDefault(); applyFilters(0); });
  $("#clear-filters").addEventListener("click", () => { $("#filters").reset(); applyFilters(0); });
  $("#prev").addEventListener("click", () => applyFilters(Math.max(0, offset - PAGE)));
  $("#next").addEventListener("click", () => applyFilters(offset + PAGE));
  window.addEventListener("hashchange", route);
  route();
  document.body.dataset.ready = "1";
}

main().catch((err) => {
  document.body.prepend(el("div", { class: "error", text: `tempering view: ${err.message || err}` }));
});
