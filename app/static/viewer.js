/*
 * Attention viewer: POST /attention once per text and level, then switch kind, layer and
 * head in the browser. Heatmaps are drawn on <canvas>: rows are queries, columns are keys.
 * No build step, no dependencies.
 */
"use strict";

(() => {
  const EXAMPLE = "Zwei junge Männer spielen Fußball auf einer Wiese.";
  const LOADING_RETRIES = 30;
  const FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif";
  const KIND_AXES = {
    cross: { rows: "target_tokens", cols: "source_tokens", note: "rows: target tokens (queries) · columns: source tokens (keys)" },
    encoder: { rows: "source_tokens", cols: "source_tokens", note: "rows and columns: source tokens (queries × keys)" },
    decoder: { rows: "target_tokens", cols: "target_input_tokens", note: "rows: target tokens (queries) · columns: decoder inputs (keys)" },
  };
  // Viridis, sampled at 9 points; interpolated into a 256-entry table below.
  const VIRIDIS = [
    [68, 1, 84], [71, 44, 122], [59, 81, 139], [44, 113, 142], [33, 144, 141],
    [39, 173, 129], [92, 200, 99], [170, 220, 50], [253, 231, 37],
  ];

  const $ = (id) => document.getElementById(id);
  const state = { data: null, kind: "cross", layer: 0, head: "all", alignment: false, request: null };
  const layouts = new WeakMap(); // canvas -> geometry and content, for hit-testing and redraws

  class ApiError extends Error {
    constructor(status, type, message, retryAfter) {
      super(message);
      this.status = status;
      this.type = type;
      this.retryAfter = retryAfter;
    }
  }

  // ---------- colours ----------

  const LUT = (() => {
    const table = [];
    for (let i = 0; i < 256; i++) {
      const x = (i / 255) * (VIRIDIS.length - 1);
      const lo = Math.floor(x);
      const hi = Math.min(lo + 1, VIRIDIS.length - 1);
      const f = x - lo;
      const c = VIRIDIS[lo].map((v, j) => Math.round(v + (VIRIDIS[hi][j] - v) * f));
      table.push(`rgb(${c[0]},${c[1]},${c[2]})`);
    }
    return table;
  })();

  function colour(value, vmax) {
    const t = vmax > 0 ? Math.min(Math.max(value / vmax, 0), 1) : 0;
    return LUT[Math.round(t * 255)];
  }

  // ---------- HTTP ----------

  // The API key the translation page keeps (for a server that requires one).
  function apiKey() {
    try {
      return window.localStorage.getItem("translator.apiKey") || "";
    } catch (_) {
      return "";
    }
  }

  async function api(path, body, signal) {
    const headers = body === undefined ? {} : { "Content-Type": "application/json" };
    if (apiKey()) headers["X-API-Key"] = apiKey();
    let response;
    try {
      response = await fetch(path, {
        method: body === undefined ? "GET" : "POST",
        headers,
        body: body === undefined ? undefined : JSON.stringify(body),
        signal,
      });
    } catch (err) {
      if (err.name === "AbortError") throw err;
      throw new ApiError(0, "network_error", `Cannot reach the server (${err.message}).`);
    }
    let payload = null;
    try {
      payload = await response.json();
    } catch (_) {
      payload = null;
    }
    if (!response.ok) {
      const message = payload && payload.error ? payload.error : `HTTP ${response.status} ${response.statusText}`;
      const type = payload && payload.error_type ? payload.error_type : "http_error";
      throw new ApiError(response.status, type, message, Number(response.headers.get("Retry-After")) || 0);
    }
    if (payload === null) throw new ApiError(response.status, "bad_response", "The server sent something that is not JSON.");
    return payload;
  }

  // ---------- messages ----------

  function setState(name) {
    $("app").dataset.state = name;
  }

  function showStatus(text) {
    $("status").textContent = text;
  }

  function showError(err) {
    const box = $("error");
    box.replaceChildren();
    const title = document.createElement("strong");
    title.textContent = err.status ? `Error ${err.status} (${err.type})` : `Error (${err.type || "client_error"})`;
    const text = document.createElement("span");
    text.textContent = err.message;
    box.append(title, text);
    box.dataset.errorType = err.type || "";
    box.hidden = false;
  }

  function clearError() {
    $("error").hidden = true;
    $("error").replaceChildren();
  }

  // ---------- translate ----------

  function requestBody() {
    const [source, target] = $("direction").value.split("-");
    const body = { q: $("source-text").value, source, target, level: $("level").value };
    const beam = Number.parseInt($("beam-size").value, 10);
    if (Number.isFinite(beam)) body.beam_size = beam;
    return body;
  }

  async function translate(retries = 0) {
    if (state.request) state.request.abort();
    const controller = new AbortController();
    state.request = controller;
    const started = performance.now();
    setState("loading");
    $("translate-button").disabled = true;
    showStatus("Translating…");
    clearError();
    try {
      const data = await api("/attention", requestBody(), controller.signal);
      if (controller !== state.request) return;
      showResult(data, performance.now() - started);
      setState("ready");
      showStatus("");
    } catch (err) {
      if (err.name === "AbortError" || controller !== state.request) return;
      if (err.status === 503 && err.type === "not_ready" && retries < LOADING_RETRIES) {
        const wait = Math.min(Math.max(err.retryAfter, 1), 5);
        showStatus(`The model is still loading; retrying in ${wait} s…`);
        setTimeout(() => { if (controller === state.request) translate(retries + 1); }, wait * 1000);
        return;
      }
      setState("error");
      showStatus("");
      showError(err);
    } finally {
      if (controller === state.request) $("translate-button").disabled = false;
    }
  }

  function showResult(data, elapsedMs) {
    state.data = data;
    $("translation").textContent = data.translatedText;
    $("translation").lang = data.target;
    $("result-meta").textContent =
      `${data.source_tokens.length} source and ${data.target_tokens.length} target tokens (${data.level}s, </s> included)` +
      ` · ${data.n_layers} layers × ${data.n_heads} heads · ${Math.round(elapsedMs)} ms`;
    for (const id of ["result", "controls", "viewer"]) $(id).hidden = false;
    fillChoices(data);
    render();
  }

  // ---------- controls ----------

  function fillSelect(select, options, selected) {
    select.replaceChildren(...options.map(([value, label]) => new Option(label, String(value))));
    const values = options.map(([value]) => String(value));
    select.value = values.includes(String(selected)) ? String(selected) : values[values.length - 1];
  }

  function fillChoices(data) {
    fillSelect($("layer"), data.layers.map((l) => [l, `${l}`]), state.layer);
    fillSelect($("head"), [["all", "All heads"], ...data.heads.map((h) => [h, `${h}`])], state.head);
    state.layer = Number($("layer").value);
    state.head = $("head").value;
    const kinds = Object.keys(data.attention);
    for (const input of document.querySelectorAll("input[name=kind]")) input.disabled = !kinds.includes(input.value);
    if (!kinds.includes(state.kind)) state.kind = kinds[0];
    $(`kind-${state.kind}`).checked = true;
  }

  function readControls() {
    state.kind = document.querySelector("input[name=kind]:checked").value;
    state.layer = Number($("layer").value);
    state.head = $("head").value;
    state.alignment = $("show-alignment").checked;
  }

  async function loadDirections(wanted) {
    try {
      const languages = await api("/languages");
      const options = [];
      for (const lang of languages) {
        for (const target of lang.targets) {
          const name = (code) => (languages.find((l) => l.code === code) || { name: code }).name;
          options.push([`${lang.code}-${target}`, `${name(lang.code)} → ${name(target)}`]);
        }
      }
      if (options.length) fillSelect($("direction"), options, wanted || $("direction").value);
    } catch (_) {
      // Keep the built-in German → English choice; /attention will report a real problem.
    }
  }

  // ---------- drawing ----------

  function selectedMaps() {
    const data = state.data;
    const axes = KIND_AXES[state.kind];
    const layerPos = data.layers.indexOf(state.layer);
    const heads = state.head === "all" ? data.heads : [Number(state.head)];
    const panels = heads.map((h) => ({ head: h, matrix: data.attention[state.kind][layerPos][data.heads.indexOf(h)] }));
    return { rows: data[axes.rows], cols: data[axes.cols], panels, note: axes.note };
  }

  function alignedCells() {
    if (!state.alignment || state.kind !== "cross" || !state.data) return new Set();
    return new Set(state.data.alignment.map((a) => `${a.target_index},${a.source_index}`));
  }

  // Axis labels drop the "▁" word-start marker (it reads as a stray bar once rotated) and mark
  // pieces that continue a word with "·" instead; the tooltip shows the exact token.
  function display(token, level) {
    if (level !== "subword" || /^<.+>$/.test(token)) return token;
    return token.startsWith("▁") ? token.slice(1) || "▁" : `·${token}`;
  }

  function shorten(token, max) {
    return token.length > max ? `${token.slice(0, max - 1)}…` : token;
  }

  function labelWidth(tokens, fontPx, maxChars) {
    const ctx = document.createElement("canvas").getContext("2d");
    ctx.font = `${fontPx}px ${FONT}`;
    return Math.ceil(Math.max(0, ...tokens.map((t) => ctx.measureText(shorten(t, maxChars)).width))) + 8;
  }

  // Panels per row and cell size: as large as possible while every panel fits the width and,
  // when it can, the height left in the window; long texts scroll instead of shrinking to dust.
  function planLayout(width, height, nPanels, rows, cols) {
    const single = nPanels === 1;
    const fontPx = single ? 13 : 11;
    const maxChars = single ? 18 : 12;
    const rowLabel = labelWidth(rows, fontPx, maxChars);
    const colLabel = labelWidth(cols, fontPx, maxChars);
    const gap = 16;
    const caption = single ? 0 : 22;
    const minCell = single ? 8 : 5;
    const maxCell = single ? 40 : 28;
    const fits = [];
    const balanced = new Set();
    for (let n = 1; n <= Math.min(nPanels, 4); n++) balanced.add(Math.ceil(nPanels / Math.ceil(nPanels / n))); // 4 heads: 1, 2 or 4 a row, never 3 + 1
    for (const perRow of balanced) {
      const panelWidth = Math.floor((width - gap * (perRow - 1)) / perRow);
      const gridRows = Math.ceil(nPanels / perRow);
      const byWidth = Math.floor((panelWidth - rowLabel - 4) / cols.length);
      const byHeight = Math.floor((height - gridRows * (colLabel + caption) - gap * (gridRows - 1)) / (gridRows * rows.length));
      fits.push({ perRow, byWidth, cell: Math.min(byWidth, byHeight, maxCell) });
    }
    let best = fits.reduce((a, b) => (b.cell >= a.cell ? b : a));
    if (best.cell < minCell) {
      const wide = fits.filter((f) => f.byWidth >= minCell);
      best = wide.length ? wide[wide.length - 1] : fits[0];
      best = { perRow: best.perRow, cell: Math.min(Math.max(best.byWidth, minCell), single ? 16 : 10) };
    }
    return { perRow: best.perRow, cell: best.cell, rowLabel, colLabel, fontPx, maxChars };
  }

  function availableHeight(container) {
    const top = container.getBoundingClientRect().top + window.scrollY;
    // Side by side with the form the maps start near the top; stacked below it they get a screenful.
    return top < window.innerHeight / 2 ? window.innerHeight - top - 40 : window.innerHeight * 0.85;
  }

  function render() {
    if (!state.data) return;
    readControls();
    const { rows, cols, panels, note } = selectedMaps();
    const level = state.data.level;
    const container = $("heatmaps");
    const width = Math.max(container.clientWidth, 200);
    const labels = { rows: rows.map((t) => display(t, level)), cols: cols.map((t) => display(t, level)) };
    const plan = { ...planLayout(width, availableHeight(container), panels.length, labels.rows, labels.cols), labels };
    const vmax = Math.max(1e-6, ...panels.flatMap((p) => p.matrix.map((row) => Math.max(...row))));
    const aligned = alignedCells();
    container.dataset.kind = state.kind;
    container.dataset.layer = String(state.layer);
    container.dataset.head = state.head;
    container.dataset.level = state.data.level;
    container.style.gridTemplateColumns = `repeat(${plan.perRow}, minmax(0, max-content))`;
    container.classList.toggle("grid", panels.length > 1);
    container.replaceChildren(...panels.map((p) => makePanel(p, rows, cols, plan, vmax, aligned, panels.length > 1)));
    $("axes-note").textContent = level === "subword" ? `${note} · “·” continues a word` : note;
    $("legend-max").textContent = vmax.toFixed(2);
    $("show-alignment").disabled = state.kind !== "cross";
    $("show-alignment").parentElement.title = state.kind === "cross" ? "" : "Alignment is derived from cross-attention";
  }

  function makePanel(panel, rows, cols, plan, vmax, aligned, titled) {
    const box = document.createElement("figure");
    box.className = "panel";
    box.dataset.head = String(panel.head);
    if (titled) {
      const caption = document.createElement("figcaption");
      caption.textContent = `Head ${panel.head}`;
      box.append(caption);
    }
    const canvas = document.createElement("canvas");
    canvas.className = "heatmap";
    canvas.dataset.rows = String(rows.length);
    canvas.dataset.cols = String(cols.length);
    canvas.dataset.kind = state.kind;
    canvas.dataset.layer = String(state.layer);
    canvas.dataset.head = String(panel.head);
    canvas.dataset.cell = String(plan.cell); // CSS pixels per cell; the map starts at x = data-origin-x, y = 0
    canvas.dataset.originX = String(plan.rowLabel);
    canvas.setAttribute("role", "img");
    canvas.setAttribute("aria-label",
      `${state.kind} attention, layer ${state.layer}, head ${panel.head}: ${rows.length} query × ${cols.length} key tokens`);
    layouts.set(canvas, { ...plan, matrix: panel.matrix, rows, cols, vmax, aligned, head: panel.head, hover: null });
    draw(canvas);
    canvas.addEventListener("pointermove", onPointer);
    canvas.addEventListener("pointerdown", onPointer);
    // A finger lifts before "pointerleave" fires: keep the tooltip until the next tap elsewhere.
    canvas.addEventListener("pointerleave", (event) => { if (event.pointerType !== "touch") hover(canvas, null); });
    box.append(canvas);
    return box;
  }

  function draw(canvas) {
    const g = layouts.get(canvas);
    const { cell, rowLabel, colLabel, rows, cols, matrix } = g;
    const width = rowLabel + cols.length * cell + 2;
    const height = rows.length * cell + colLabel + 2;
    const dpr = window.devicePixelRatio || 1;
    if (canvas.width !== Math.round(width * dpr) || canvas.height !== Math.round(height * dpr)) {
      canvas.width = Math.round(width * dpr);
      canvas.height = Math.round(height * dpr);
      canvas.style.width = `${width}px`;
      canvas.style.height = `${height}px`;
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    for (let r = 0; r < rows.length; r++) {
      for (let c = 0; c < cols.length; c++) {
        ctx.fillStyle = colour(matrix[r][c], g.vmax);
        ctx.fillRect(rowLabel + c * cell, r * cell, cell, cell);
      }
    }
    drawMarks(ctx, g);
    drawLabels(ctx, g);
  }

  function drawMarks(ctx, g) {
    const { cell, rowLabel } = g;
    const box = (r, c, colourName, lineWidth) => {
      ctx.strokeStyle = colourName;
      ctx.lineWidth = lineWidth;
      ctx.strokeRect(rowLabel + c * cell + lineWidth / 2, r * cell + lineWidth / 2, cell - lineWidth, cell - lineWidth);
    };
    for (const key of g.aligned) {
      const [r, c] = key.split(",").map(Number);
      box(r, c, "#ff3d7f", Math.max(1.5, Math.min(3, cell / 6)));
    }
    if (g.hover) {
      ctx.fillStyle = "rgba(255,255,255,0.18)";
      ctx.fillRect(rowLabel, g.hover.r * cell, g.cols.length * cell, cell);
      ctx.fillRect(rowLabel + g.hover.c * cell, 0, cell, g.rows.length * cell);
      box(g.hover.r, g.hover.c, "#ffffff", 2);
    }
  }

  function drawLabels(ctx, g) {
    const { cell, rowLabel, fontPx, maxChars } = g;
    const { rows, cols } = g.labels;
    const size = Math.min(fontPx, Math.max(8, cell - 1));
    const every = Math.max(1, Math.ceil((size + 1) / cell)); // thin labels out when cells are smaller than text
    const styleFor = (i, hovered) => {
      ctx.font = `${hovered ? "600 " : ""}${size}px ${FONT}`;
      ctx.fillStyle = hovered ? "#b3003c" : "#1f2430";
    };
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    rows.forEach((token, r) => {
      const hovered = g.hover && g.hover.r === r;
      if (r % every && !hovered) return;
      styleFor(r, hovered);
      ctx.fillText(shorten(token, maxChars), rowLabel - 5, r * cell + cell / 2);
    });
    cols.forEach((token, c) => {
      const hovered = g.hover && g.hover.c === c;
      if (c % every && !hovered) return;
      styleFor(c, hovered);
      ctx.save();
      ctx.translate(rowLabel + c * cell + cell / 2, rows.length * cell + 5);
      ctx.rotate(-Math.PI / 2);
      ctx.fillText(shorten(token, maxChars), 0, 0);
      ctx.restore();
    });
  }

  // ---------- hover and tooltip ----------

  function cellAt(canvas, event) {
    const g = layouts.get(canvas);
    const rect = canvas.getBoundingClientRect();
    const scale = rect.width / (canvas.width / (window.devicePixelRatio || 1));
    const x = (event.clientX - rect.left) / scale - g.rowLabel;
    const y = (event.clientY - rect.top) / scale;
    const c = Math.floor(x / g.cell);
    const r = Math.floor(y / g.cell);
    return r >= 0 && r < g.rows.length && c >= 0 && c < g.cols.length && x >= 0 ? { r, c } : null;
  }

  function onPointer(event) {
    const canvas = event.currentTarget;
    const where = cellAt(canvas, event);
    hover(canvas, where);
    if (where) placeTooltip(event.clientX, event.clientY);
  }

  function hover(canvas, where) {
    const g = layouts.get(canvas);
    const same = (a, b) => (a === null && b === null) || (a && b && a.r === b.r && a.c === b.c);
    if (!same(g.hover, where)) {
      g.hover = where;
      draw(canvas);
    }
    const tip = $("tooltip");
    if (!where) {
      tip.hidden = true;
      return;
    }
    const value = g.matrix[where.r][where.c];
    tip.replaceChildren();
    const pair = document.createElement("div");
    pair.className = "tooltip-pair";
    const query = document.createElement("span");
    query.dataset.role = "query";
    query.textContent = g.rows[where.r];
    const key = document.createElement("span");
    key.dataset.role = "key";
    key.textContent = g.cols[where.c];
    pair.append(query, " → ", key);
    const weight = document.createElement("div");
    weight.className = "tooltip-weight";
    weight.dataset.role = "weight";
    weight.textContent = value.toFixed(4);
    const where_ = document.createElement("div");
    where_.className = "tooltip-where";
    where_.textContent = `layer ${state.layer} · head ${g.head} · row ${where.r}, column ${where.c}`;
    tip.append(pair, weight, where_);
    tip.hidden = false;
  }

  function placeTooltip(x, y) {
    const tip = $("tooltip");
    const pad = 14;
    const { offsetWidth: w, offsetHeight: h } = tip;
    const left = x + pad + w > window.innerWidth ? Math.max(4, x - pad - w) : x + pad;
    const top = y + pad + h > window.innerHeight ? Math.max(4, y - pad - h) : y + pad;
    tip.style.left = `${left}px`;
    tip.style.top = `${top}px`;
  }

  // ---------- wiring ----------

  function debounce(fn, ms) {
    let timer = null;
    return () => {
      clearTimeout(timer);
      timer = setTimeout(fn, ms);
    };
  }

  function init() {
    const params = new URLSearchParams(window.location.search);
    $("source-text").value = params.get("q") || $("source-text").value || EXAMPLE;
    if (params.get("level") === "word") $("level").value = "word";
    $("translate-form").addEventListener("submit", (event) => {
      event.preventDefault();
      translate();
    });
    $("source-text").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
        event.preventDefault();
        translate();
      }
    });
    $("level").addEventListener("change", () => translate()); // word maps come from the server
    for (const id of ["layer", "head", "show-alignment"]) $(id).addEventListener("change", render);
    for (const input of document.querySelectorAll("input[name=kind]")) input.addEventListener("change", render);
    window.addEventListener("resize", debounce(render, 150));
    document.addEventListener("pointerdown", (event) => {
      if (event.target instanceof HTMLCanvasElement) return;
      for (const canvas of document.querySelectorAll("canvas.heatmap")) hover(canvas, null);
    });
    // The translation page links here with its direction and sentence: ?source=de&target=en&q=...
    const wanted = params.get("source") && params.get("target") ? `${params.get("source")}-${params.get("target")}` : null;
    if (wanted) loadDirections(wanted).then(() => translate());
    else {
      loadDirections();
      translate();
    }
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
