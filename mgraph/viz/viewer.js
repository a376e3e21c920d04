// mgraph viewer: the graph (SVG), the schedule and the timeline (canvas) of one page's data.
// Plain JavaScript, no libraries: the page must open offline. Data layout: mgraph/viz/data.py.
"use strict";
const D = JSON.parse(document.getElementById("mgraph-data").textContent);
const G = D.graph, S = D.schedule, T = D.trace, TK = G.tasks;
const N = TK.name.length, NE = G.edges.src.length;
const LINK_COLORS = ["#8c8c8c", "#2ca02c", "#d62728"];  // local, nvlink, rdma
const ROLE_COLORS = { compute: "#1f77b4", nvlink: "#2ca02c", rdma: "#d62728" };
const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
  "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173"];
const stageColor = (s) => PALETTE[s % PALETTE.length];
const $ = (id) => document.getElementById(id);
const SVGNS = "http://www.w3.org/2000/svg";

function human(n, unit) {
  const units = unit === "B" ? ["B", "KiB", "MiB", "GiB", "TiB"] : ["", "K", "M", "G", "T"];
  const base = unit === "B" ? 1024 : 1000;
  let i = 0;
  while (Math.abs(n) >= base && i < units.length - 1) { n /= base; i++; }
  return (i ? n.toFixed(n < 10 ? 2 : 1) : String(Math.round(n))) + " " + units[i] + (unit === "B" ? "" : unit);
}
const roleName = (t) => G.roles[TK.role[t]];

// ---- derived tables ---------------------------------------------------------------------
const waitersOf = G.events.map(() => []), signalersOf = G.events.map(() => []);
for (let t = 0; t < N; t++) {
  const w = TK.waits[t];
  for (let i = 0; i < w.length; i += 2) waitersOf[w[i]].push(t);
  for (const e of TK.signals[t]) signalersOf[e].push(t);
}
const queuePos = new Map();  // task -> [rank, role, index, length]
if (S) for (const rs of S.ranks) for (const [role, q] of Object.entries(rs.queues))
  q.forEach((t, i) => queuePos.set(t, [rs.rank, role, i, q.length]));
const traceOf = new Map();
if (T) T.task.forEach((t, i) => traceOf.set(t, i));
// stage columns: stages ordered by the earliest dependency depth of their tasks (Kahn's order)
const depth = new Int32Array(N), indeg = new Int32Array(N), outs = Array.from({ length: N }, () => []);
for (let e = 0; e < NE; e++) { outs[G.edges.src[e]].push(G.edges.dst[e]); indeg[G.edges.dst[e]]++; }
{
  const queue = []; for (let t = 0; t < N; t++) if (!indeg[t]) queue.push(t);
  for (let h = 0; h < queue.length; h++) {
    const t = queue[h];
    for (const u of outs[t]) { depth[u] = Math.max(depth[u], depth[t] + 1); if (!--indeg[u]) queue.push(u); }
  }
}
const stageDepth = G.stages.map(() => Infinity);
for (let t = 0; t < N; t++) stageDepth[TK.stage[t]] = Math.min(stageDepth[TK.stage[t]], depth[t]);
const stageOrder = G.stages.map((_, s) => s).sort((a, b) => stageDepth[a] - stageDepth[b] || a - b);
const stageRole = G.stages.map(() => null);
for (let t = 0; t < N; t++) if (stageRole[TK.stage[t]] === null) stageRole[TK.stage[t]] = roleName(t);

// ---- summary, tabs, legends ---------------------------------------------------------------
{
  const linkBytes = [0, 0, 0];
  for (let e = 0; e < NE; e++) linkBytes[G.edges.link[e]] += G.edges.bytes[e];
  $("summary").textContent = `${G.op} · ${G.topology} (${G.world} GPUs) · ${G.dtype} · ` +
    `${N} tasks in ${G.stages.length} ops/stages · ${NE} dependencies · ` +
    (S ? `schedule ${S.policy} on ${S.hardware} · ` : "") +
    (T ? `run: ${T.backend}, ${(T.makespan_us / 1e3).toFixed(3)} ms` : "no run recorded");
}
function legend(el, items) {
  el.innerHTML = items.map(([c, l]) => `<span class="sw" style="background:${c}"></span>${l}`).join("");
}
legend($("graph-legend"), [...G.links.map((l, i) => [LINK_COLORS[i], l + " edge"]),
  ...Object.entries(ROLE_COLORS).map(([r, c]) => [c, r + " task"])]);
function showTab(name) {
  for (const b of document.querySelectorAll(".tab")) b.classList.toggle("active", b.dataset.tab === name);
  for (const p of document.querySelectorAll(".pane")) p.classList.toggle("active", p.id === "pane-" + name);
  if (name === "timeline") drawTimeline();
}
for (const b of document.querySelectorAll(".tab")) b.onclick = () => showTab(b.dataset.tab);

// ---- details panel ----------------------------------------------------------------------------
function regionList(flat) {
  const out = [];
  for (let i = 0; i < flat.length; i += 5) {
    const [id, rank, , , , item] = G.buffers[flat[i]];
    const bytes = (flat[i + 2] - flat[i + 1]) * (flat[i + 4] - flat[i + 3]) * item;
    out.push(`${id}[${flat[i + 1]}:${flat[i + 2]},${flat[i + 3]}:${flat[i + 4]}] (rank ${rank}, ${human(bytes, "B")})`);
  }
  return out;
}
const taskLink = (t) => `<a class="task" data-task="${t}">${TK.name[t]}</a>`;
function taskLinks(ts) {
  const shown = ts.slice(0, 6).map(taskLink).join(", ");
  return shown + (ts.length > 6 ? ` and ${ts.length - 6} more` : "");
}
function showTask(t) {
  selectTask(t);
  const rows = [["id", t], ["rank", `${TK.rank[t]} (node ${Math.floor(TK.rank[t] / G.gpus_per_node)})`],
    ["role", roleName(t)], ["kind", G.kinds[TK.kind[t]]], ["op / stage", G.stages[TK.stage[t]]],
    ["link", G.links[TK.link[t]]], ["flops", human(TK.flops[t], "FLOP")], ["bytes", human(TK.bytes[t], "B")]];
  if (G.cost_us) rows.push(["cost (model)", G.cost_us[t].toFixed(2) + " us"]);
  const q = queuePos.get(t);
  if (q) rows.push(["queue", `#${q[2] + 1} of ${q[3]} in rank ${q[0]}'s ${q[1]} queue`]);
  if (traceOf.has(t)) {
    const i = traceOf.get(t);
    rows.push(["ran", `${T.start[i].toFixed(2)} – ${T.end[i].toFixed(2)} us on ${T.roles[T.role[i]]} worker ${T.worker[i]}`]);
  }
  const w = TK.waits[t], waits = [];
  for (let i = 0; i < w.length; i += 2) {
    const [rank, name] = G.events[w[i]];
    waits.push(`event ${w[i]} “${name}” (rank ${rank}) ≥ ${w[i + 1]}, from ${taskLinks([...new Set(signalersOf[w[i]])])}`);
  }
  const signals = TK.signals[t].map((e) => `event ${e} “${G.events[e][1]}” (rank ${G.events[e][0]}) → ${taskLinks(waitersOf[e])}`);
  const list = (title, items) => `<div class="sec">${title} (${items.length})</div><ul>` +
    items.map((x) => `<li>${x}</li>`).join("") + "</ul>";
  $("details").innerHTML = `<h2 id="detail-name">${TK.name[t]}</h2><table>` +
    rows.map(([k, v]) => `<tr><td>${k}</td><td>${v}</td></tr>`).join("") + "</table>" +
    list("reads", regionList(TK.reads[t])) + list("writes", regionList(TK.writes[t])) +
    list("waits", waits) + list("signals", signals);
}
$("details").addEventListener("click", (ev) => {
  const a = ev.target.closest("a.task");
  if (a) showTask(+a.dataset.task);
  const b = ev.target.closest("button[data-expand]");
  if (b) { graph.expanded.add(+b.dataset.expand); drawGraph(); }
});

// ---- graph: ops (stages) per lane, expandable to tiles ------------------------------------------
const graph = { laneBy: "rank", rank: -1, expanded: new Set(), zoom: 1, selected: -1 };
const TILE_BUDGET = 6000, CELL = 9, TILE_ROWS = 16, AGG_W = 150, AGG_H = 44;
{
  const sel = $("rank-filter");
  sel.innerHTML = `<option value="-1">all</option>` +
    Array.from({ length: G.world }, (_, r) => `<option value="${r}">${r}</option>`).join("");
  sel.onchange = () => { graph.rank = +sel.value; drawGraph(); };
  $("lane-by").onchange = () => { graph.laneBy = $("lane-by").value; drawGraph(); };
  $("expand-all").onclick = () => { G.stages.forEach((_, s) => graph.expanded.add(s)); drawGraph(true); };
  $("collapse-all").onclick = () => { graph.expanded.clear(); drawGraph(true); };
  $("zoom-in").onclick = () => { graph.zoom *= 1.25; sizeGraph(); };
  $("zoom-out").onclick = () => { graph.zoom /= 1.25; sizeGraph(); };
}
const laneOf = (t) => graph.laneBy === "rank" ? TK.rank[t] : TK.role[t];
const laneLabel = (l) => graph.laneBy === "rank" ? `rank ${l} (node ${Math.floor(l / G.gpus_per_node)})` : G.roles[l];
let unitOfTask = null, graphSize = [0, 0];

function el(tag, attrs, parent, text) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  parent.appendChild(e);
  return e;
}
function drawGraph(fit) {
  const svg = $("graph-svg");
  svg.innerHTML = "";
  const visible = (t) => graph.rank < 0 || TK.rank[t] === graph.rank;
  const groups = new Map();  // "stage:lane" -> tasks
  for (let t = 0; t < N; t++) if (visible(t)) {
    const k = TK.stage[t] + ":" + laneOf(t);
    if (!groups.has(k)) groups.set(k, []);
    groups.get(k).push(t);
  }
  const lanes = [...new Set([...groups.keys()].map((k) => +k.split(":")[1]))].sort((a, b) => a - b);
  let expandedTasks = 0, expandedGroups = 0;
  for (const [k, ts] of groups) if (graph.expanded.has(+k.split(":")[0])) { expandedTasks += ts.length; expandedGroups++; }
  // a budget of drawn tiles; past it each group shows its first tiles and one "+N more" node
  const cap = expandedTasks > TILE_BUDGET ? Math.max(16, Math.floor(TILE_BUDGET / expandedGroups)) : Infinity;
  $("graph-hint").textContent = (graph.expanded.size ? "" : "Each box is one op stage on one lane; double-click it (or click, then “expand”) to see its tiles. ") +
    (cap < Infinity ? `Showing ${cap} tiles per op and lane (of ${expandedTasks}); pick one rank to see all.` : "") +
    " Edges: dependencies, coloured by the link the data crosses, labelled with bytes.";
  // columns: one per stage present; width from its widest lane
  const stagesShown = stageOrder.filter((s) => lanes.some((l) => groups.has(s + ":" + l)));
  const colW = new Map(), laneH = new Map();
  for (const s of stagesShown) {
    let w = AGG_W;
    for (const l of lanes) {
      const ts = groups.get(s + ":" + l);
      if (!ts || !graph.expanded.has(s)) continue;
      const n = Math.min(ts.length, cap) + (ts.length > cap ? 1 : 0);
      w = Math.max(w, Math.ceil(n / TILE_ROWS) * CELL + 40);
      laneH.set(l, Math.max(laneH.get(l) || 0, Math.min(n, TILE_ROWS) * CELL + 26));
    }
    colW.set(s, w);
  }
  const LEFT = 130, TOP = 28;
  const colX = new Map();
  let x = LEFT;
  for (const s of stagesShown) { colX.set(s, x); x += colW.get(s) + 100; }
  const laneY = new Map();
  let y = TOP;
  for (const l of lanes) { laneY.set(l, y); y += Math.max(AGG_H + 16, laneH.get(l) || 0); }
  graphSize = [x + 20, y + 10];
  const gl = el("g", { id: "lanes" }, svg), ge = el("g", { id: "edges" }, svg), gn = el("g", { id: "nodes" }, svg);
  lanes.forEach((l, i) => {
    const h = Math.max(AGG_H + 16, laneH.get(l) || 0);
    el("rect", { class: "lane-bg lane" + (i % 2 ? " odd" : ""), x: 0, y: laneY.get(l), width: graphSize[0], height: h, "data-lane": l }, gl);
    el("text", { x: 6, y: laneY.get(l) + 18 }, gl, laneLabel(l));
  });
  for (const s of stagesShown) el("text", { x: colX.get(s), y: 16, "font-weight": "bold" }, gl,
    G.stages[s] + (graph.expanded.has(s) ? " (tiles)" : ""));
  // units: aggregated boxes and tiles; a task maps to the unit that draws it
  unitOfTask = new Int32Array(N).fill(-1);
  const units = [];  // {x, y, w, h, tasks, stage, lane, tile}
  for (const s of stagesShown) for (const l of lanes) {
    const ts = groups.get(s + ":" + l);
    if (!ts) continue;
    const x0 = colX.get(s), y0 = laneY.get(l) + 8;
    if (!graph.expanded.has(s)) {
      units.push({ x: x0, y: y0, w: AGG_W, h: AGG_H, tasks: ts, stage: s, lane: l, tile: false });
      continue;
    }
    ts.forEach((t, i) => {
      if (i < cap) units.push({ x: x0 + Math.floor(i / TILE_ROWS) * CELL, y: y0 + (i % TILE_ROWS) * CELL, w: CELL - 1, h: CELL - 1, tasks: [t], stage: s, lane: l, tile: true });
    });
    if (ts.length > cap) {
      const i = cap;
      units.push({ x: x0 + Math.floor(i / TILE_ROWS) * CELL, y: y0 + (i % TILE_ROWS) * CELL, w: CELL * 3, h: CELL - 1, tasks: ts.slice(cap), stage: s, lane: l, tile: false, more: true });
    }
  }
  units.forEach((u, i) => { for (const t of u.tasks) unitOfTask[t] = i; });
  // edges between units, merged per (unit, unit, link)
  const edges = new Map();
  for (let e = 0; e < NE; e++) {
    const a = unitOfTask[G.edges.src[e]], b = unitOfTask[G.edges.dst[e]];
    if (a < 0 || b < 0 || a === b) continue;
    const k = a + ":" + b + ":" + G.edges.link[e];
    const m = edges.get(k) || edges.set(k, { a, b, link: G.edges.link[e], n: 0, bytes: 0 }).get(k);
    m.n++; m.bytes += G.edges.bytes[e];
  }
  const maxBytes = Math.max(1, ...[...edges.values()].map((m) => m.bytes));
  const label = edges.size <= 150;
  for (const m of edges.values()) {
    const ua = units[m.a], ub = units[m.b];
    const x1 = ua.x + ua.w, y1 = ua.y + ua.h / 2, x2 = ub.x, y2 = ub.y + ub.h / 2;
    const dx = Math.max(30, Math.abs(x2 - x1) / 2);
    const p = el("path", {
      class: "edge", d: `M${x1},${y1} C${x1 + dx},${y1} ${x2 - dx},${y2} ${x2},${y2}`,
      stroke: LINK_COLORS[m.link], "stroke-width": (0.8 + 3.5 * Math.sqrt(m.bytes / maxBytes)).toFixed(2),
      "data-a": m.a, "data-b": m.b, "data-link": G.links[m.link],
    }, ge);
    el("title", {}, p, `${G.links[m.link]}: ${m.n} dependencies, ${human(m.bytes, "B")}`);
    // labels only between neighbouring columns: a longer edge's midpoint lies on another box
    const adjacent = stagesShown.indexOf(ub.stage) - stagesShown.indexOf(ua.stage) === 1;
    if (label && adjacent && !ua.tile && !ub.tile) el("text", { class: "edge-label", "text-anchor": "middle", x: (x1 + x2) / 2, y: (y1 + y2) / 2 - 3, fill: LINK_COLORS[m.link] }, ge, human(m.bytes, "B"));
  }
  units.forEach((u, i) => {
    const color = ROLE_COLORS[stageRole[u.stage]] || stageColor(u.stage);
    const r = el("rect", { class: "node " + (u.tile ? "tile" : "agg"), x: u.x, y: u.y, width: u.w, height: u.h,
      fill: u.tile ? color : color + "22", stroke: color, "data-unit": i, "data-task": u.tile ? u.tasks[0] : "" }, gn);
    if (u.tile) { el("title", {}, r, TK.name[u.tasks[0]]); return; }
    r.setAttribute("stroke-width", 2);
    el("text", { x: u.x + 6, y: u.y + 15, "font-weight": "bold" }, gn, u.more ? `+${u.tasks.length}` : G.stages[u.stage]);
    if (!u.more) el("text", { x: u.x + 6, y: u.y + 31 }, gn,
      `${u.tasks.length} × ${G.kinds[TK.kind[u.tasks[0]]]} (${stageRole[u.stage]})`);
  });
  graph.units = units;
  if (fit) graph.zoom = Math.min(1, ($("graph-scroll").clientWidth - 4) / graphSize[0]);
  sizeGraph();
  if (graph.selected >= 0) selectTask(graph.selected, true);
}
function sizeGraph() {
  const svg = $("graph-svg");
  svg.setAttribute("viewBox", `0 0 ${graphSize[0]} ${graphSize[1]}`);
  svg.setAttribute("width", graphSize[0] * graph.zoom);
  svg.setAttribute("height", graphSize[1] * graph.zoom);
}
function selectTask(t, quiet) {
  graph.selected = t;
  for (const n of document.querySelectorAll(".node.selected, .node.nbr")) n.classList.remove("selected", "nbr");
  for (const e of document.querySelectorAll(".edge.hot")) e.classList.remove("hot");
  if (!unitOfTask || unitOfTask[t] < 0) return;
  const u = unitOfTask[t];
  const node = document.querySelector(`.node[data-unit="${u}"]`);
  if (node) node.classList.add("selected");
  for (const e of document.querySelectorAll(`.edge[data-a="${u}"], .edge[data-b="${u}"]`)) {
    e.classList.add("hot");
    const other = e.dataset.a == u ? e.dataset.b : e.dataset.a;
    const n = document.querySelector(`.node[data-unit="${other}"]`);
    if (n) n.classList.add("nbr");
  }
  if (!quiet && timeline.ready) drawTimeline();
}
function showGroup(u) {
  const ts = u.tasks;
  let flops = 0, bytes = 0, cost = 0;
  for (const t of ts) { flops += TK.flops[t]; bytes += TK.bytes[t]; if (G.cost_us) cost += G.cost_us[t]; }
  const linkIn = [0, 0, 0], linkOut = [0, 0, 0], mine = new Set(ts);
  for (let e = 0; e < NE; e++) {
    const a = mine.has(G.edges.src[e]), b = mine.has(G.edges.dst[e]);
    if (a && !b) linkOut[G.edges.link[e]] += G.edges.bytes[e];
    if (b && !a) linkIn[G.edges.link[e]] += G.edges.bytes[e];
  }
  const fmt = (arr) => G.links.map((l, i) => `${l} ${human(arr[i], "B")}`).join(", ");
  $("details").innerHTML = `<h2 id="detail-name">${G.stages[u.stage]} · ${laneLabel(u.lane)}</h2><table>` +
    `<tr><td>tasks</td><td>${ts.length}</td></tr><tr><td>role</td><td>${stageRole[u.stage]}</td></tr>` +
    `<tr><td>flops</td><td>${human(flops, "FLOP")}</td></tr><tr><td>bytes</td><td>${human(bytes, "B")}</td></tr>` +
    (G.cost_us ? `<tr><td>cost (model)</td><td>${cost.toFixed(1)} us of work</td></tr>` : "") +
    `<tr><td>in</td><td>${fmt(linkIn)}</td></tr><tr><td>out</td><td>${fmt(linkOut)}</td></tr></table>` +
    `<p><button data-expand="${u.stage}">expand “${G.stages[u.stage]}” to tiles</button></p>` +
    `<div class="sec">tasks</div><ul>${ts.slice(0, 40).map((t) => `<li>${taskLink(t)}</li>`).join("")}` +
    (ts.length > 40 ? `<li>… ${ts.length - 40} more</li>` : "") + "</ul>";
}
$("graph-svg").addEventListener("click", (ev) => {
  const n = ev.target.closest(".node");
  if (!n) return;
  const u = graph.units[+n.dataset.unit];
  if (u.tile) showTask(u.tasks[0]); else { showGroup(u); selectTask(u.tasks[0], true); n.classList.add("selected"); }
});
$("graph-svg").addEventListener("dblclick", (ev) => {
  const n = ev.target.closest(".node.agg");
  if (n) { graph.expanded.add(graph.units[+n.dataset.unit].stage); drawGraph(); }
});
