// mgraph viewer, part 2: the schedule (SM split, role queues) and the run's timeline on canvas.
// Uses the tables viewer.js built (D, G, S, T, TK, showTask, ...); inlined after it.
"use strict";

// ---- schedule: per rank, the SM split and each role queue's order ------------------------------
const QUEUE_W = 900;
function drawSchedule() {
  const body = $("schedule-body");
  if (!S) { $("schedule-hint").textContent = "No schedule in this file."; return; }
  $("schedule-hint").textContent = `Policy ${S.policy} on ${S.hardware} (${S.sms} SMs per GPU). ` +
    "Bars: how each GPU's SMs are split between roles. Strips: each role queue in execution order, " +
    "coloured by op stage; click a strip to open the task at that position.";
  legend($("schedule-legend"), stageOrder.map((s) => [stageColor(s), G.stages[s]]));
  body.innerHTML = "";
  for (const rs of S.ranks) {
    const div = document.createElement("div");
    div.className = "sched-rank";
    const used = Object.values(rs.workers).reduce((a, b) => a + b, 0);
    const parts = Object.entries(rs.workers).map(([role, n]) =>
      `<div style="width:${(100 * n) / S.sms}%;background:${ROLE_COLORS[role] || "#999"}" title="${role}: ${n} SMs">${role} ${n} SMs</div>`);
    if (used < S.sms) parts.push(`<div style="width:${(100 * (S.sms - used)) / S.sms}%;background:#ccc;color:#333">idle ${S.sms - used}</div>`);
    div.innerHTML = `<div class="head">rank ${rs.rank} · ${rs.batches} proxy batches</div><div class="smbar">${parts.join("")}</div>`;
    for (const [role, q] of Object.entries(rs.queues)) {
      if (!q.length) continue;
      const row = document.createElement("div");
      row.className = "qrow";
      row.innerHTML = `<span class="lbl">${role} queue: ${q.length} tasks</span>`;
      const c = document.createElement("canvas");
      c.width = QUEUE_W; c.height = 14; c.className = "queue"; c.dataset.rank = rs.rank; c.dataset.role = role;
      const ctx = c.getContext("2d");
      for (let x = 0; x < QUEUE_W; x++) {  // one pixel column per slice of the queue
        const t = q[Math.min(q.length - 1, Math.floor((x * q.length) / QUEUE_W))];
        ctx.fillStyle = stageColor(TK.stage[t]);
        ctx.fillRect(x, 0, Math.max(1, QUEUE_W / q.length - (q.length < 200 ? 1 : 0)), 14);
      }
      const at = (ev) => q[Math.min(q.length - 1, Math.floor((ev.offsetX * q.length) / QUEUE_W))];
      c.onmousemove = (ev) => { c.title = TK.name[at(ev)]; };
      c.onclick = (ev) => showTask(at(ev));
      row.appendChild(c);
      div.appendChild(row);
    }
    body.appendChild(div);
  }
}

// ---- timeline: per-worker lanes, critical path, bandwidth per link ------------------------------
const timeline = { ready: false, mode: null, t0: 0, t1: 1, lanes: [], laneOf: null };
const GUTTER = 120;
function buildLanes() {
  const key = (i) => timeline.mode === "worker" ? `${T.rank[i]}:${T.role[i]}:${T.worker[i]}` : `${T.rank[i]}:${T.role[i]}`;
  const keys = new Map();
  const order = T.task.map((_, i) => i).sort((a, b) => T.rank[a] - T.rank[b] || T.role[a] - T.role[b] || T.worker[a] - T.worker[b]);
  timeline.laneOf = new Int32Array(T.task.length);
  for (const i of order) {
    const k = key(i);
    if (!keys.has(k)) keys.set(k, { rank: T.rank[i], role: T.roles[T.role[i]], worker: T.worker[i], recs: [] });
    const lane = keys.get(k);
    lane.recs.push(i);
  }
  timeline.lanes = [...keys.values()];
  timeline.lanes.forEach((l, n) => { for (const i of l.recs) timeline.laneOf[i] = n; l.recs.sort((a, b) => T.start[a] - T.start[b]); });
  timeline.critical = new Set(T.critical);
}
function setupTimeline() {
  if (!T) {
    $("timeline-hint").textContent = "No run in this file: view a RunResult, or `mgraph view --timeline sim`.";
    return;
  }
  const workers = new Set(T.task.map((_, i) => `${T.rank[i]}:${T.role[i]}:${T.worker[i]}`)).size;
  timeline.mode = workers <= 160 ? "worker" : "role";  // past that, lanes would be < 3 px tall
  $("tl-lanes").value = timeline.mode;
  $("tl-lanes").onchange = () => { timeline.mode = $("tl-lanes").value; buildLanes(); drawTimeline(); };
  $("tl-critical").onchange = () => drawTimeline();
  $("tl-reset").onclick = () => { timeline.t0 = 0; timeline.t1 = T.makespan_us * 1.02 || 1; drawTimeline(); };
  timeline.t1 = T.makespan_us * 1.02 || 1;
  legend($("timeline-legend"), [...stageOrder.map((s) => [stageColor(s), G.stages[s]]), ["#000", "critical path (red outline)"]]);
  buildLanes();
  timeline.ready = true;
  const c = $("tl-canvas");
  c.addEventListener("wheel", (ev) => {
    ev.preventDefault();
    const f = ev.deltaY > 0 ? 1.25 : 0.8, at = tAt(ev.offsetX);
    timeline.t0 = at - (at - timeline.t0) * f; timeline.t1 = at + (timeline.t1 - at) * f;
    drawTimeline();
  }, { passive: false });
  let drag = null;
  c.addEventListener("mousedown", (ev) => { drag = { x: ev.offsetX, t0: timeline.t0, t1: timeline.t1, moved: false }; });
  window.addEventListener("mouseup", () => { setTimeout(() => { drag = null; }, 0); });
  c.addEventListener("mousemove", (ev) => {
    if (!drag || !(ev.buttons & 1)) return;
    const dt = ((ev.offsetX - drag.x) / (c.width - GUTTER)) * (drag.t1 - drag.t0);
    if (Math.abs(ev.offsetX - drag.x) > 3) drag.moved = true;
    timeline.t0 = drag.t0 - dt; timeline.t1 = drag.t1 - dt;
    drawTimeline();
  });
  c.addEventListener("click", (ev) => {
    if (drag && drag.moved) return;
    const i = recordAt(ev.offsetX, ev.offsetY);
    if (i >= 0) showTask(T.task[i]);
  });
}
const laneHeight = () => Math.max(3, Math.min(16, Math.floor(560 / Math.max(1, timeline.lanes.length))));
const tAt = (x) => timeline.t0 + ((x - GUTTER) / ($("tl-canvas").width - GUTTER)) * (timeline.t1 - timeline.t0);
const xAt = (t) => GUTTER + ((t - timeline.t0) / (timeline.t1 - timeline.t0)) * ($("tl-canvas").width - GUTTER);
function recordAt(x, y) {
  const lane = timeline.lanes[Math.floor((y - 18) / laneHeight())];
  if (!lane) return -1;
  const t = tAt(x), slack = (2 * (timeline.t1 - timeline.t0)) / $("tl-canvas").width;
  let best = -1;
  for (const i of lane.recs) if (T.start[i] - slack <= t && t <= T.end[i] + slack) best = i;
  return best;
}
function drawTimeline() {
  if (!timeline.ready) return;
  const c = $("tl-canvas"), lh = laneHeight();
  c.width = Math.max(600, c.parentElement.clientWidth - 30);
  c.height = 18 + lh * timeline.lanes.length + 4;
  c.dataset.lanes = timeline.lanes.length;
  const ctx = c.getContext("2d");
  ctx.clearRect(0, 0, c.width, c.height);
  ctx.font = "10px sans-serif";
  ctx.fillStyle = "#333";
  for (let k = 0; k <= 8; k++) {  // time axis
    const t = timeline.t0 + (k / 8) * (timeline.t1 - timeline.t0), x = xAt(t);
    ctx.fillText(t.toFixed(1) + " us", x - 14, 11);
    ctx.fillStyle = "#eee"; ctx.fillRect(x, 14, 1, c.height); ctx.fillStyle = "#333";
  }
  let drawn = 0, prevRank = -1;
  const selected = graph.selected;
  timeline.lanes.forEach((lane, n) => {
    const y = 18 + n * lh;
    if (lane.rank !== prevRank) {  // a rank's first lane: a separator and its label
      ctx.fillStyle = "#999"; ctx.fillRect(0, y, c.width, 1);
      prevRank = lane.rank;
    }
    ctx.fillStyle = ROLE_COLORS[lane.role] || "#666";
    if (lh >= 8 || lane.worker === 0) ctx.fillText(timeline.mode === "worker" ? `r${lane.rank} ${lane.role} ${lane.worker}` : `rank ${lane.rank} ${lane.role}`, 2, y + Math.min(lh, 11) - 1);
    for (const i of lane.recs) {
      if (T.end[i] < timeline.t0 || T.start[i] > timeline.t1) continue;
      const x0 = Math.max(GUTTER, xAt(T.start[i])), x1 = xAt(T.end[i]);
      ctx.fillStyle = stageColor(TK.stage[T.task[i]]);
      ctx.globalAlpha = timeline.mode === "role" ? 0.35 : 1;
      ctx.fillRect(x0, y + 1, Math.max(1, x1 - x0 - 0.5), lh - 2);
      drawn++;
    }
    ctx.globalAlpha = 1;
  });
  if ($("tl-critical").checked) {  // the critical path: red outlines joined by a line
    ctx.strokeStyle = "#d62728"; ctx.lineWidth = 2;
    ctx.beginPath();
    for (const i of T.critical) {
      const y = 18 + timeline.laneOf[i] * lh + lh / 2;
      ctx.lineTo(xAt(T.start[i]), y); ctx.lineTo(xAt(T.end[i]), y);
    }
    ctx.stroke();
    for (const i of T.critical) {
      const y = 18 + timeline.laneOf[i] * lh;
      ctx.strokeRect(xAt(T.start[i]), y + 0.5, Math.max(2, xAt(T.end[i]) - xAt(T.start[i])), lh - 1);
    }
  }
  if (selected >= 0 && traceOf.has(selected)) {
    const i = traceOf.get(selected), y = 18 + timeline.laneOf[i] * lh;
    ctx.strokeStyle = "#000"; ctx.lineWidth = 3;
    ctx.strokeRect(xAt(T.start[i]) - 2, y - 1, Math.max(4, xAt(T.end[i]) - xAt(T.start[i]) + 4), lh + 2);
  }
  c.dataset.drawn = drawn;
  $("timeline-hint").textContent = `${T.backend} run, ${(T.makespan_us / 1e3).toFixed(3)} ms; ${timeline.lanes.length} lanes; ` +
    `critical path ${T.critical.length} tasks. Wheel: zoom, drag: pan, click: task details.`;
  drawBandwidth();
}
function drawBandwidth() {
  const c = $("bw-canvas"), bw = T.bandwidth;
  c.width = $("tl-canvas").width; c.height = 130;
  const ctx = c.getContext("2d");
  ctx.clearRect(0, 0, c.width, c.height);
  const peak = Math.max(1e-9, ...bw.gbps.flat());
  ctx.font = "10px sans-serif"; ctx.fillStyle = "#333";
  ctx.fillText(`${peak.toFixed(1)} GB/s`, 2, 12); ctx.fillText("0", 2, c.height - 4);
  bw.gbps.forEach((row, link) => {
    if (!row.some((v) => v > 0)) return;
    ctx.strokeStyle = LINK_COLORS[link]; ctx.lineWidth = 1.5;
    ctx.beginPath();
    row.forEach((v, k) => {
      const y = c.height - 4 - (v / peak) * (c.height - 18);
      ctx.lineTo(xAt(k * bw.bin_us), y); ctx.lineTo(xAt((k + 1) * bw.bin_us), y);
    });
    ctx.stroke();
    ctx.fillStyle = LINK_COLORS[link];
    ctx.fillText(`${G.links[link]} (peak ${Math.max(...row).toFixed(1)} GB/s)`, GUTTER + 10 + 170 * (link - 1), 12);
  });
}

showTab("graph");
drawGraph(true);
drawSchedule();
setupTimeline();
window.mgraphViewer = { graph, timeline, showTask, showTab, drawGraph };
