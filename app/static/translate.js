/*
 * The translation page. Reads /frontend/settings, /languages and /info once; translates as the
 * user types (POST /translate, debounced, the request before cancelled); on demand, the word
 * alignment of each sentence from the cross-attention (POST /attention, level "word"), shown as
 * highlights behind the source text; files through /translate_file. The state is in the URL.
 * No build step, no dependencies.
 */
"use strict";

(() => {
  const PIVOT = "en"; // pairs without a model of their own go through English (app/serving/pivots.py)
  const MAX_ALIGNED_SENTENCES = 8;
  const MAX_ALTERNATIVES = 3;
  const LOADING_RETRIES = 60;
  // The maps come from translating a sentence alone; when that gives another translation (a
  // wider beam for alternatives, say), they are not this translation's.
  const DIFFERENT = "the sentence translated alone comes out differently";

  const $ = (id) => document.getElementById(id);
  const state = {
    settings: null,
    languages: [], // [{code, name, targets}]
    direct: new Map(), // "de-en" -> the model card's beam size
    maxAlternatives: 0,
    maxBeam: 8,
    seq: 0, // the newest /translate request; an answer to an older one is dropped
    controller: null,
    alignController: null,
    result: null, // the translation shown (see showTranslation)
    selected: null, // {s, w}: the translation word whose alignment shows (clicked or keyed)
    hovered: null,
    retry: null, // {timer}: a 429's wait counting down
    xhr: null,
    debounce: null,
  };

  class ApiError extends Error {
    constructor(status, type, message, retryAfter) {
      super(message);
      this.status = status;
      this.type = type;
      this.retryAfter = retryAfter;
    }
  }

  // ---------- HTTP ----------

  function apiKey() {
    return $("key-row").hidden ? "" : $("api-key").value.trim();
  }

  async function api(path, body, signal) {
    const headers = {};
    if (body !== undefined) headers["Content-Type"] = "application/json";
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
      throw new ApiError(0, "network_error", String(err.message || err));
    }
    let payload = null;
    try {
      payload = await response.json();
    } catch (err) {
      if (err.name === "AbortError") throw err;
    }
    if (!response.ok) throw errorOf(response.status, payload, response.headers.get("Retry-After"));
    if (payload === null) throw new ApiError(response.status, "bad_response", "the answer is not JSON");
    return payload;
  }

  function errorOf(status, payload, retryAfter) {
    const message = payload && payload.error ? payload.error : `HTTP ${status}`;
    const type = payload && payload.error_type ? payload.error_type : "http_error";
    return new ApiError(status, type, message, Number(retryAfter) || 0);
  }

  // ---------- languages ----------

  const displayNames = (() => {
    try {
      return new Intl.DisplayNames(["en"], { type: "language" });
    } catch (_) {
      return null;
    }
  })();

  function languageName(code) {
    const known = state.languages.find((l) => l.code === code);
    if (known && known.name && known.name !== code) return known.name;
    try {
      return (displayNames && displayNames.of(code)) || code;
    } catch (_) {
      return code;
    }
  }

  function targetsOf(source) {
    if (source === "auto") {
      const all = new Set(state.languages.flatMap((l) => l.targets));
      return state.languages.map((l) => l.code).filter((c) => all.has(c));
    }
    const lang = state.languages.find((l) => l.code === source);
    return lang ? lang.targets : [];
  }

  function fillSources(wanted) {
    const select = $("source");
    const codes = state.languages.filter((l) => l.targets.length).map((l) => l.code);
    select.replaceChildren(
      new Option("Detect language", "auto"),
      ...codes.map((c) => new Option(languageName(c), c)),
    );
    select.value = codes.includes(wanted) ? wanted : "auto";
  }

  function fillTargets(wanted) {
    const select = $("target");
    const source = concreteSource();
    const codes = targetsOf($("source").value).filter((c) => c !== source || $("source").value === "auto");
    select.replaceChildren(...codes.map((c) => new Option(languageName(c), c)));
    const fallback = codes.includes(PIVOT) && source !== PIVOT ? PIVOT : codes[0];
    select.value = codes.includes(wanted) ? wanted : fallback || "";
  }

  function concreteSource() {
    const chosen = $("source").value;
    if (chosen !== "auto") return chosen;
    return state.result && state.result.source !== "auto" ? state.result.source : null;
  }

  // ---------- messages ----------

  function announce(text) {
    const region = $("announce");
    region.textContent = "";
    window.setTimeout(() => { region.textContent = text; }, 50);
  }

  function plural(n, word) {
    return `${n} ${word}${n === 1 ? "" : "s"}`;
  }

  function bytes(n) {
    if (n >= 1e6) return `${(n / 1e6).toFixed(n % 1e6 ? 1 : 0)} MB`;
    if (n >= 1e3) return `${(n / 1e3).toFixed(n % 1e3 ? 1 : 0)} kB`;
    return plural(n, "byte");
  }

  // An API error in words: a title and a sentence or two, never a bare status.
  function describe(err, what = "text") {
    const m = err.message || "";
    const wait = err.retryAfter ? ` Try again in ${plural(err.retryAfter, "second")}.` : " Try again shortly.";
    switch (err.type) {
      case "network_error":
        return ["The server cannot be reached", "Check the connection and try again."];
      case "rate_limited": {
        const limit = /(\d+) requests per (\w+)/.exec(m);
        const rule = limit ? ` (this server allows ${plural(Number(limit[1]), "request")} per ${limit[2]})` : "";
        return ["Too many requests", `You have sent too many requests for now${rule}.${wait}`];
      }
      case "queue_full":
        return ["The server is busy", `It has more work queued than it can take now.${wait}`];
      case "file_too_large": {
        const size = /larger than (\d+) bytes/.exec(m);
        return ["The file is too large", `This server takes files of up to ${size ? bytes(Number(size[1])) : "its limit"}.`];
      }
      case "payload_too_large":
        return ["Too large to send", `The ${what} is larger than this server accepts in one request.`];
      case "too_many_sentences":
        return ["Too many sentences at once", `The ${what} has more sentences than the server can queue; translate it in parts.`];
      case "too_many_characters": {
        const n = /(\d+) characters in this request; at most (\d+)/.exec(m);
        if (!n) return ["The text is too long", capitalise(m)];
        const [given, most] = [Number(n[1]), Number(n[2])].map((x) => x.toLocaleString("en"));
        return ["The text is too long", `It has ${given} characters; this server takes at most ${most} per request.`];
      }
      case "text_too_long":
        return ["The text is too long", `${capitalise(m)}. Shorten it or split it into several parts.`];
      case "unsupported_language": {
        const found = /looks like '([^']+)' \((\d+)%\)/.exec(m);
        const served = state.languages.filter((l) => l.targets.length).map((l) => languageName(l.code));
        const from = served.length ? ` It translates from ${served.join(", ")}.` : "";
        return [
          "This language is not supported",
          found
            ? `The text looks like ${languageName(found[1])} (${found[2]} % sure), which no model on this server translates.${from}`
            : `No model on this server translates the language of this text.${from}`,
        ];
      }
      case "unsupported_language_pair": {
        const pair = /no model for ([\w-]+)->([\w-]+)/.exec(m);
        if (pair && pair[1] === pair[2]) {
          const language = languageName(pair[1]);
          return [
            "Nothing to translate",
            `The text is already in ${language}, the language chosen to translate to. Choose another target language.`,
          ];
        }
        const why = pair ? `No model here translates ${languageName(pair[1])} into ${languageName(pair[2])}.` : m;
        return ["This pair of languages is not supported", why];
      }
      case "unsupported_file_format":
      case "unsupported_media_type":
        return ["This kind of file is not supported", `Files this server translates: ${formats().join(", ")}.`];
      case "forbidden":
        return apiKey()
          ? ["The API key was not accepted", "Check the key in the API key field."]
          : ["An API key is needed", "This server translates only for clients with a key: enter yours in the API key field."];
      case "suggestions_disabled":
        return ["Suggestions are off", "This server does not take suggestions."];
      case "not_ready":
        return ["The models are still loading", "The translation will start as soon as they are ready."];
      case "shutting_down":
        return ["The server is restarting", `It is not taking new work right now.${wait}`];
      case "storage_unavailable":
        return ["Files cannot be stored right now", `The server's file store is not reachable.${wait}`];
      case "timeout":
        return ["The translation took too long", `The server stopped it. Try a shorter ${what}.`];
      case "not_found":
        return ["The file is gone", "Translated files are kept for a while only: translate it again."];
      case "empty_text":
        return ["Nothing to translate", `The ${what} is empty.`];
      default:
        return [err.status ? `Error ${err.status}` : "Something went wrong", capitalise(m) || "The server gave no reason."];
    }
  }

  function capitalise(text) {
    return text ? text[0].toUpperCase() + text.slice(1) : text;
  }

  function renderError(box, err, what) {
    const [title, text] = describe(err, what);
    const heading = document.createElement("strong");
    heading.textContent = title;
    const body = document.createElement("span");
    body.className = "error-text";
    body.textContent = text;
    box.replaceChildren(heading, body);
    box.dataset.errorType = err.type || "";
    box.dataset.status = String(err.status || "");
    box.hidden = false;
  }

  function showError(err) {
    renderError($("error"), err, "text");
    $("app").dataset.state = "error";
  }

  function clearError() {
    stopCountdown();
    $("error").hidden = true;
    $("error").replaceChildren();
    delete $("error").dataset.errorType;
  }

  // A 429 (or a busy or loading server) says how long to wait: count it down in the message,
  // then try again by itself.
  function countdown(err, again) {
    stopCountdown();
    let left = Math.max(1, err.retryAfter || 1);
    const tick = () => {
      const text = $("error").querySelector(".error-text");
      const again = `Try again in ${plural(left, "second")}.`;
      if (text) text.textContent = text.textContent.replace(/Try again in \d+ seconds?\.|Try again shortly\./, again);
      $("error").dataset.wait = String(left);
    };
    tick();
    const timer = window.setInterval(() => {
      left -= 1;
      if (left <= 0) {
        stopCountdown();
        again();
      } else tick();
    }, 1000);
    state.retry = { timer };
  }

  function stopCountdown() {
    if (state.retry) window.clearInterval(state.retry.timer);
    state.retry = null;
    delete $("error").dataset.wait;
  }

  // ---------- counting ----------

  function codePoints(text) {
    let n = 0;
    for (const _ of text) n++;
    return n;
  }

  function updateCount() {
    const limit = state.settings ? state.settings.charLimit : 0;
    const n = codePoints($("source-text").value);
    const over = limit > 0 && n > limit;
    $("char-count").textContent = limit
      ? `${n.toLocaleString("en")} / ${limit.toLocaleString("en")} characters`
      : plural(n, "character");
    $("char-count").dataset.over = String(over);
    $("source-text").setAttribute("aria-invalid", String(over));
    return { n, limit, over };
  }

  function autosize() {
    const box = $("source-text");
    box.style.height = "auto";
    box.style.height = `${box.scrollHeight + 2}px`;
  }

  // ---------- URL ----------

  function syncUrl() {
    const params = new URLSearchParams();
    params.set("source", $("source").value);
    if ($("target").value) params.set("target", $("target").value);
    const q = $("source-text").value;
    if (q) params.set("q", q);
    const url = `${window.location.pathname}?${params.toString().replace(/\+/g, "%20")}`;
    if (url !== window.location.pathname + window.location.search) window.history.replaceState(null, "", url);
    updateViewerLink();
  }

  function currentSentence() {
    const text = $("source-text").value;
    const r = state.result;
    const active = state.hovered || state.selected;
    if (r && active && r.sentences[active.s] && r.sentences[active.s].range) {
      const [start, end] = r.sentences[active.s].range;
      return text.slice(start, end);
    }
    const caret = $("source-text").selectionStart || 0;
    if (typeof Intl.Segmenter === "function") {
      const segmenter = new Intl.Segmenter(concreteSource() || "en", { granularity: "sentence" });
      for (const seg of segmenter.segment(text)) {
        if (caret <= seg.index + seg.segment.length && seg.segment.trim()) return seg.segment.trim();
      }
    }
    return text.trim().split(/(?<=[.!?])\s+/)[0] || "";
  }

  function updateViewerLink() {
    const params = new URLSearchParams();
    const source = concreteSource();
    if (source) params.set("source", source);
    if ($("target").value) params.set("target", $("target").value);
    const sentence = currentSentence();
    if (sentence) params.set("q", sentence);
    const query = params.toString().replace(/\+/g, "%20");
    $("viewer-link").href = query ? `/viewer?${query}` : "/viewer";
  }

  // ---------- translating ----------

  function schedule() {
    window.clearTimeout(state.debounce);
    const wait = state.settings ? Math.min(Math.max(state.settings.frontendTimeout, 150), 1000) : 400;
    state.debounce = window.setTimeout(translate, wait);
  }

  function cancelTranslation() {
    window.clearTimeout(state.debounce);
    state.seq += 1; // whatever is on its way is now stale
    if (state.controller) state.controller.abort();
    state.controller = null;
    cancelAlignment();
  }

  async function translate(attempt = 0) {
    cancelTranslation();
    syncUrl();
    const text = $("source-text").value;
    const { over, n, limit } = updateCount();
    stopCountdown();
    if (!state.settings || !$("target").value) return;
    if (!text.trim()) {
      clearError();
      clearResult();
      $("app").dataset.state = "idle";
      return;
    }
    if (over) {
      const err = new ApiError(400, "too_many_characters", `q: ${n} characters in this request; at most ${limit}`);
      clearResult();
      showError(err);
      return;
    }
    const controller = new AbortController();
    state.controller = controller;
    const seq = state.seq;
    const source = $("source").value;
    const target = $("target").value;
    const alternatives = $("want-alternatives").checked ? state.maxAlternatives : 0;
    const body = { q: text, source, target, details: true };
    if (alternatives) body.alternatives = alternatives;
    $("translation").setAttribute("aria-busy", "true");
    $("app").dataset.state = "translating";
    try {
      const data = await api("/translate", body, controller.signal);
      if (seq !== state.seq) return; // a newer request went out: never show an older answer
      clearError();
      showTranslation({ text, source, target, alternatives, data });
      $("app").dataset.state = "ready";
    } catch (err) {
      if (err.name === "AbortError" || seq !== state.seq) return;
      clearResult(); // the error says why; a translation of an earlier text would mislead
      if (err.type === "not_ready" && attempt < LOADING_RETRIES) {
        showError(err);
        window.setTimeout(() => { if (seq === state.seq) translate(attempt + 1); }, 2000);
        return;
      }
      showError(err);
      if (err.status === 429 || err.type === "shutting_down") countdown(err, () => translate());
      if (err.type === "forbidden") $("api-key").focus();
    } finally {
      if (seq === state.seq) {
        $("translation").setAttribute("aria-busy", "false");
        state.controller = null;
      }
    }
  }

  function clearResult() {
    state.result = null;
    state.selected = state.hovered = null;
    $("translation").replaceChildren();
    $("translation").dataset.empty = "true";
    $("alternatives").hidden = true;
    $("alternatives-list").replaceChildren();
    $("align-info").textContent = "";
    $("detected").textContent = "";
    $("suggest-form").hidden = true;
    highlightSource([]);
    updateViewerLink();
  }

  // Pieces -> words as model/network/attention_words.py merges them: a word starts at a piece
  // with "▁"; special pieces (<s>, </s>, <unk>) stand alone.
  function mergePieces(pieces) {
    const words = [];
    let joinable = false;
    for (const piece of pieces) {
      if (/^<.+>$/.test(piece) && piece.length > 2) {
        words.push(piece);
        joinable = false;
      } else if (piece.startsWith("▁") || !joinable) {
        words.push(piece.replace(/^▁/, ""));
        joinable = true;
      } else {
        words[words.length - 1] += piece;
      }
    }
    return words.map((w) => w || "▁");
  }

  const isSpecial = (word) => /^<.+>$/.test(word) && word.length > 2;

  // Where each word is in ``text`` (from ``from`` on, in order): [start, end] or null.
  function locate(text, words, from = 0) {
    let cursor = from;
    return words.map((word) => {
      if (!word || isSpecial(word)) return null;
      const at = text.indexOf(word, cursor);
      if (at < 0 || text.slice(cursor, at).trim().length > 40) return null; // not where it should be
      cursor = at + word.length;
      return [at, at + word.length];
    });
  }

  function showTranslation({ text, source, target, alternatives, data }) {
    const detected = data.detectedLanguage || null;
    const concrete = detected ? detected.language : source;
    const details = data.details || { sentences: [] };
    const translation = data.translatedText;
    // (without /info every pair counts as direct: /attention says which it serves)
    const pivot = state.direct.size > 0 && !state.direct.has(`${concrete}-${target}`) && concrete !== PIVOT && target !== PIVOT;
    const sentences = [];
    let srcCursor = 0;
    let tgtCursor = 0;
    const pieces = pivot ? segmentSentences(text, concrete) : null;
    details.sentences.forEach((s, i) => {
      const entry = { source: s.source, translation: s.translation, range: null, tgtRange: null, words: [], align: null };
      if (pivot) {
        entry.intermediate = s.source;
        const seg = pieces && pieces.length === details.sentences.length ? pieces[i] : null;
        entry.source = seg ? seg.text : null;
        entry.range = seg ? [seg.start, seg.end] : null;
      } else {
        const at = text.indexOf(s.source, srcCursor);
        if (at >= 0) {
          entry.range = [at, at + s.source.length];
          srcCursor = at + s.source.length;
          const words = mergePieces(s.source_tokens).filter((w) => !isSpecial(w));
          entry.sourceWords = words;
          entry.sourceRanges = locate(text, words, at).map((r) => (r && r[1] <= entry.range[1] ? r : null));
        }
      }
      const tat = translation.indexOf(s.translation, tgtCursor);
      if (tat >= 0) {
        entry.tgtRange = [tat, tat + s.translation.length];
        tgtCursor = tat + s.translation.length;
        entry.words = mergePieces(s.target_tokens).filter((w) => !isSpecial(w));
        entry.wordRanges = locate(translation, entry.words, tat).map((r) => (r && r[1] <= entry.tgtRange[1] ? r : null));
      }
      sentences.push(entry);
    });
    state.result = { text, source: concrete, requested: source, target, translation, pivot, sentences, alternatives };
    state.selected = state.hovered = null;
    renderTranslation();
    if (detected) {
      const confidence = formatConfidence(detected.confidence);
      $("detected").textContent = `Detected: ${languageName(detected.language)} (${confidence} % confidence)`;
      $("detected").dataset.language = detected.language;
    } else {
      $("detected").textContent = "";
      delete $("detected").dataset.language;
    }
    const alts = data.alternatives || [];
    $("alternatives-list").replaceChildren(
      ...alts.map((a) => {
        const item = document.createElement("li");
        item.textContent = a;
        item.lang = target;
        return item;
      }),
    );
    $("alternatives").hidden = !alternatives;
    if (alternatives && !alts.length) {
      const item = document.createElement("li");
      item.textContent = "No other translation found.";
      $("alternatives-list").append(item);
    }
    if (!$("suggest-form").hidden) $("suggestion").value = translation;
    $("align-info").textContent = "";
    highlightSource([]);
    updateViewerLink();
  }

  function formatConfidence(value) {
    return Number(value).toLocaleString("en", { maximumFractionDigits: 1 });
  }

  function segmentSentences(text, lang) {
    if (typeof Intl.Segmenter !== "function") return null;
    const out = [];
    for (const seg of new Intl.Segmenter(lang, { granularity: "sentence" }).segment(text)) {
      const trimmed = seg.segment.trim();
      if (!trimmed) continue;
      const start = seg.index + seg.segment.indexOf(trimmed);
      out.push({ text: trimmed, start, end: start + trimmed.length });
    }
    return out;
  }

  // The translation as text with each located word in a span (data-s: sentence, data-w: word).
  function renderTranslation() {
    const r = state.result;
    const out = $("translation");
    const parts = [];
    let cursor = 0;
    r.sentences.forEach((s, si) => {
      (s.wordRanges || []).forEach((range, wi) => {
        if (!range) return;
        if (range[0] > cursor) parts.push(document.createTextNode(r.translation.slice(cursor, range[0])));
        const span = document.createElement("span");
        span.className = "w";
        span.dataset.s = String(si);
        span.dataset.w = String(wi);
        span.textContent = r.translation.slice(range[0], range[1]);
        parts.push(span);
        cursor = range[1];
      });
    });
    if (cursor < r.translation.length) parts.push(document.createTextNode(r.translation.slice(cursor)));
    out.replaceChildren(...parts);
    out.lang = r.target;
    out.dataset.empty = String(!r.translation);
  }

  // ---------- alignment ----------

  function cancelAlignment() {
    if (state.alignController) state.alignController.abort();
    state.alignController = null;
  }

  // Fetch the alignments of the shown translation's sentences (once): when the pointer or the
  // focus reaches the translation, so typing alone costs no extra requests.
  function ensureAlignment() {
    const r = state.result;
    if (!r || r.aligning) return;
    r.aligning = true;
    const controller = new AbortController();
    state.alignController = controller;
    const todo = r.sentences.slice(0, MAX_ALIGNED_SENTENCES);
    r.sentences.slice(MAX_ALIGNED_SENTENCES).forEach((s) => {
      s.align = { error: `only the first ${MAX_ALIGNED_SENTENCES} sentences are aligned` };
    });
    todo.forEach((s) => {
      s.align = { pending: true };
      alignSentence(r, s, controller.signal)
        .then((align) => { s.align = align; })
        .catch((err) => {
          const why = err instanceof ApiError ? describe(err)[0].toLowerCase() : err.message;
          s.align = { error: err.name === "AbortError" ? "aborted" : why };
        })
        .finally(() => {
          if (state.result === r) refreshHighlight();
        });
    });
  }

  async function alignSentence(r, s, signal) {
    if (!s.tgtRange || !s.source) throw new Error("its sentence could not be found in the text");
    if (!r.pivot) {
      const leg = await attention(s.source, r.source, r.target, s.translation, signal);
      if (!sameWords(leg.targetWords, s.words)) throw new Error(DIFFERENT);
      if (!s.sourceRanges) s.sourceRanges = locate(r.text, leg.sourceWords, s.range[0]);
      return { matrix: leg.matrix, sourceWords: leg.sourceWords };
    }
    // Through the pivot: (target × English) · (English × source) words.
    const first = await attention(s.source, r.source, PIVOT, s.intermediate, signal);
    const second = await attention(s.intermediate, PIVOT, r.target, s.translation, signal);
    if (!sameWords(second.targetWords, s.words) || first.targetWords.length !== second.sourceWords.length) {
      throw new Error(DIFFERENT);
    }
    s.sourceRanges = locate(r.text, first.sourceWords, s.range[0]).map((x) => (x && x[1] <= s.range[1] ? x : null));
    const matrix = second.matrix.map((row) =>
      first.sourceWords.map((_, k) => row.reduce((sum, w, e) => sum + w * first.matrix[e][k], 0)),
    );
    return { matrix, sourceWords: first.sourceWords };
  }

  function sameWords(a, b) {
    return a.length === b.length && a.every((w, i) => w === b[i]);
  }

  // POST /attention for one sentence: its cross-attention between words, averaged over the
  // layers and heads, without </s> (rows: target words, columns: source words).
  async function attention(q, source, target, expected, signal) {
    const body = { q, source, target, level: "word", kinds: ["cross"] };
    const alternatives = state.result ? state.result.alternatives : 0;
    const card = state.direct.get(`${source}-${target}`);
    if (alternatives && card) body.beam_size = Math.min(Math.max(card, alternatives + 1), state.maxBeam);
    const data = await api("/attention", body, signal);
    if (data.translatedText.trim() !== expected.trim()) throw new Error(DIFFERENT);
    const cross = data.attention.cross;
    const rows = data.target_tokens.map((t, i) => [t, i]).filter(([t]) => !isSpecial(t));
    const cols = data.source_tokens.map((t, i) => [t, i]).filter(([t]) => !isSpecial(t));
    const count = cross.length * cross[0].length;
    const matrix = rows.map(([, ti]) =>
      cols.map(([, si]) => {
        let sum = 0;
        for (const layer of cross) for (const head of layer) sum += head[ti][si];
        return sum / count;
      }),
    );
    return { matrix, targetWords: rows.map(([t]) => t), sourceWords: cols.map(([t]) => t) };
  }

  // The source words a translation word is aligned to: the strongest, and any close to it.
  function alignedTo(s, w) {
    const row = s.align && s.align.matrix ? s.align.matrix[w] : null;
    if (!row || !row.length) return [];
    const best = Math.max(...row);
    return row
      .map((weight, k) => ({ k, weight, strong: weight === best }))
      .filter((x) => x.strong || x.weight >= 0.5 * best)
      .sort((a, b) => b.weight - a.weight)
      .slice(0, 3);
  }

  function refreshHighlight() {
    const r = state.result;
    const active = state.hovered || state.selected;
    for (const el of $("translation").querySelectorAll(".w.active")) el.classList.remove("active");
    const selection = selectedWords();
    const words = active ? [active] : selection;
    if (!r || !words.length || r.text !== $("source-text").value) {
      highlightSource([]); // (nothing chosen, or the text changed since: its words moved)
      if (r) $("align-info").textContent = "";
      return;
    }
    const marks = [];
    const infos = [];
    for (const { s: si, w: wi } of words) {
      const s = r.sentences[si];
      const span = $("translation").querySelector(`.w[data-s="${si}"][data-w="${wi}"]`);
      if (span) span.classList.add("active");
      const word = s.words[wi];
      if (!s.align || s.align.pending) {
        infos.push(`Aligning “${word}”…`);
        continue;
      }
      if (s.align.error) {
        infos.push(s.align.error !== "aborted"
          ? `No alignment for “${word}”: ${s.align.error}.`
          : `No alignment for “${word}”.`);
        continue;
      }
      const links = alignedTo(s, wi);
      for (const link of links) {
        const range = s.sourceRanges ? s.sourceRanges[link.k] : null;
        if (range) marks.push({ range, strong: link.strong, index: link.k, sentence: si });
      }
      const names = links.map((l) => `“${s.align.sourceWords[l.k]}”`);
      infos.push(names.length ? `“${word}” comes from ${names.join(" and ")}` : `No alignment for “${word}”.`);
    }
    highlightSource(marks);
    const more = infos.length > 4 ? "; …" : "";
    $("align-info").textContent = words.length > 1 ? `${infos.slice(0, 4).join("; ")}${more}` : infos[0] || "";
    updateViewerLink();
  }

  // Marks behind the text box: the backdrop holds the same text, transparent, with <mark>s.
  function highlightSource(marks) {
    const text = $("source-text").value;
    const sorted = [...marks].sort((a, b) => a.range[0] - b.range[0]);
    const nodes = [];
    let cursor = 0;
    const seen = new Set();
    for (const m of sorted) {
      const key = m.range.join(":");
      if (seen.has(key) || m.range[0] < cursor) continue;
      seen.add(key);
      nodes.push(document.createTextNode(text.slice(cursor, m.range[0])));
      const mark = document.createElement("mark");
      mark.textContent = text.slice(m.range[0], m.range[1]);
      mark.dataset.sentence = String(m.sentence);
      mark.dataset.word = String(m.index);
      if (m.strong) mark.className = "strong";
      nodes.push(mark);
      cursor = m.range[1];
    }
    nodes.push(document.createTextNode(`${text.slice(cursor)}\n`));
    $("backdrop").replaceChildren(...nodes);
  }

  function wordOf(node) {
    const el = node && (node.nodeType === 1 ? node : node.parentElement);
    const span = el && el.closest ? el.closest("#translation .w") : null;
    return span ? { s: Number(span.dataset.s), w: Number(span.dataset.w) } : null;
  }

  // Words of the translation inside the user's text selection (selecting words shows theirs).
  function selectedWords() {
    const sel = window.getSelection();
    if (!sel || sel.isCollapsed || !sel.rangeCount) return [];
    const range = sel.getRangeAt(0);
    if (!$("translation").contains(range.commonAncestorContainer)) return [];
    return [...$("translation").querySelectorAll(".w")]
      .filter((span) => range.intersectsNode(span.firstChild || span))
      .map((span) => ({ s: Number(span.dataset.s), w: Number(span.dataset.w) }));
  }

  function allWords() {
    return [...$("translation").querySelectorAll(".w")].map((span) => ({ s: Number(span.dataset.s), w: Number(span.dataset.w) }));
  }

  function moveSelection(step) {
    const words = allWords();
    if (!words.length) return;
    const current = state.selected ? words.findIndex((x) => x.s === state.selected.s && x.w === state.selected.w) : -1;
    let next;
    if (step === "first") next = 0;
    else if (step === "last") next = words.length - 1;
    else next = current < 0 ? (step > 0 ? 0 : words.length - 1) : Math.min(Math.max(current + step, 0), words.length - 1);
    state.selected = words[next];
    state.hovered = null;
    refreshHighlight();
    const span = $("translation").querySelector(`.w[data-s="${state.selected.s}"][data-w="${state.selected.w}"]`);
    if (span) span.scrollIntoView({ block: "nearest" });
  }

  // ---------- languages: choose, swap ----------

  function onSourceChange() {
    fillTargets($("target").value);
    translate();
  }

  function swap() {
    const from = $("source").value;
    const detected = $("detected").dataset.language;
    const newTarget = from === "auto" ? detected || null : from;
    const newSource = $("target").value;
    if (!newSource) return;
    const r = state.result;
    const translation = r && r.text === $("source-text").value ? r.translation : "";
    fillSources(newSource);
    fillTargets(newTarget || "");
    if (translation) {
      $("source-text").value = translation;
      autosize();
    }
    announce(`Now translating from ${languageName($("source").value)} to ${languageName($("target").value)}.`);
    translate();
  }

  // ---------- copy, alternatives, suggestions ----------

  async function copy() {
    const text = state.result ? state.result.translation : "";
    if (!text) {
      announce("There is no translation to copy yet.");
      return;
    }
    try {
      await navigator.clipboard.writeText(text);
    } catch (_) {
      const range = document.createRange();
      range.selectNodeContents($("translation"));
      const sel = window.getSelection();
      sel.removeAllRanges();
      sel.addRange(range);
      document.execCommand("copy");
      sel.removeAllRanges();
    }
    $("copy").textContent = "Copied";
    announce("The translation is copied to the clipboard.");
    window.setTimeout(() => { $("copy").textContent = "Copy"; }, 1500);
  }

  function openSuggestion() {
    if (!state.result) {
      announce("Translate something first.");
      return;
    }
    $("suggest-form").hidden = false;
    $("suggestion").value = state.result.translation;
    $("suggestion").focus();
  }

  async function sendSuggestion(event) {
    event.preventDefault();
    const r = state.result;
    const s = $("suggestion").value.trim();
    if (!r || !s) return;
    $("suggest-send").disabled = true;
    try {
      await api("/suggest", { q: r.text, s, source: r.source, target: r.target });
      $("suggest-form").hidden = true;
      clearError();
      announce("Thank you: your translation was saved.");
      $("align-info").textContent = "Thank you: your translation was saved.";
      $("suggest-open").focus();
    } catch (err) {
      showError(err);
    } finally {
      $("suggest-send").disabled = false;
    }
  }

  // ---------- files ----------

  function formats() {
    return state.settings ? state.settings.supportedFilesFormat : [];
  }

  function fileError(err) {
    renderError($("file-error"), err, "file");
  }

  function uploadFile(file) {
    if (!file) return;
    $("file-error").hidden = true;
    const dot = file.name.lastIndexOf(".");
    const suffix = dot >= 0 ? file.name.slice(dot).toLowerCase() : "";
    if (formats().length && !formats().includes(suffix)) {
      fileError(new ApiError(400, "unsupported_file_format", file.name));
      return;
    }
    if (!$("target").value) return;
    if (state.xhr) state.xhr.abort();
    const form = new FormData();
    form.append("file", file, file.name);
    form.append("source", $("source").value);
    form.append("target", $("target").value);
    const xhr = new XMLHttpRequest();
    state.xhr = xhr;
    xhr.open("POST", "/translate_file");
    if (apiKey()) xhr.setRequestHeader("X-API-Key", apiKey());
    xhr.responseType = "text";
    const progress = $("file-progress");
    const status = $("file-status");
    $("file-job").hidden = false;
    $("file-job").dataset.state = "uploading";
    $("file-download").hidden = true;
    $("file-cancel").hidden = false;
    progress.value = 0;
    status.textContent = `Sending ${file.name}…`;
    xhr.upload.onprogress = (e) => {
      if (!e.lengthComputable) return;
      progress.value = e.loaded / e.total;
      status.textContent = `Sending ${file.name}: ${Math.round((100 * e.loaded) / e.total)} %`;
    };
    xhr.upload.onload = () => {
      progress.removeAttribute("value"); // the server translates now: no measure of how far
      $("file-job").dataset.state = "translating";
      status.textContent = `Translating ${file.name}…`;
    };
    xhr.onload = () => {
      if (state.xhr !== xhr) return;
      state.xhr = null;
      $("file-cancel").hidden = true;
      let payload = null;
      try {
        payload = JSON.parse(xhr.responseText);
      } catch (_) {
        payload = null;
      }
      if (xhr.status !== 200 || !payload || !payload.translatedFileUrl) {
        const err = errorOf(xhr.status, payload, xhr.getResponseHeader("Retry-After"));
        $("file-job").hidden = true;
        fileError(err);
        return;
      }
      const url = new URL(payload.translatedFileUrl, window.location.href);
      progress.value = 1;
      $("file-job").dataset.state = "done";
      const link = $("file-download");
      link.href = url.pathname + url.search;
      link.textContent = `Download the translation of ${file.name}`;
      link.hidden = false;
      const found = payload.detectedLanguage;
      status.textContent = `${file.name} is translated${found ? ` (from ${languageName(found.language)}, detected)` : ""}.`;
      link.focus();
    };
    xhr.onerror = () => {
      if (state.xhr !== xhr) return;
      state.xhr = null;
      $("file-job").hidden = true;
      fileError(new ApiError(0, "network_error", "the upload failed"));
    };
    xhr.onabort = () => {
      $("file-job").dataset.state = "cancelled";
      $("file-cancel").hidden = true;
      status.textContent = `${file.name}: cancelled.`;
      progress.value = 0;
    };
    xhr.send(form);
  }

  function setupDropzone() {
    const zone = $("dropzone");
    const over = (on) => (event) => {
      event.preventDefault();
      zone.dataset.over = String(on);
    };
    zone.addEventListener("dragenter", over(true));
    zone.addEventListener("dragover", over(true));
    zone.addEventListener("dragleave", over(false));
    zone.addEventListener("drop", (event) => {
      over(false)(event);
      const file = event.dataTransfer && event.dataTransfer.files[0];
      uploadFile(file);
    });
    // A file dropped anywhere on the page is translated too, rather than opened in place of the page.
    const hasFiles = (event) => event.dataTransfer && [...event.dataTransfer.types].includes("Files");
    window.addEventListener("dragover", (event) => {
      if (hasFiles(event)) event.preventDefault();
    });
    window.addEventListener("drop", (event) => {
      if (!hasFiles(event) || zone.contains(event.target)) return;
      event.preventDefault();
      uploadFile(event.dataTransfer.files[0]);
    });
    $("file-input").addEventListener("change", () => {
      uploadFile($("file-input").files[0]);
      $("file-input").value = "";
    });
    $("file-cancel").addEventListener("click", () => {
      if (state.xhr) {
        const xhr = state.xhr;
        state.xhr = null;
        xhr.abort();
      }
    });
  }

  // ---------- start ----------

  async function load(attempt = 0) {
    try {
      const [settings, languages] = await Promise.all([api("/frontend/settings"), api("/languages")]);
      state.settings = settings;
      state.languages = languages;
    } catch (err) {
      if (attempt < LOADING_RETRIES && (err.type === "not_ready" || err.type === "network_error")) {
        showError(err);
        window.setTimeout(() => load(attempt + 1), 2000);
        return;
      }
      showError(err);
      return;
    }
    try {
      const info = await api("/info");
      for (const d of info.directions) {
        const beam = d.recommended_decoding && d.recommended_decoding.beam_size;
        state.direct.set(`${d.source}-${d.target}`, Number(beam) || 0);
      }
      state.maxAlternatives = Math.min(MAX_ALTERNATIVES, info.limits.max_alternatives);
      state.maxBeam = info.limits.max_beam;
    } catch (_) {
      state.maxAlternatives = MAX_ALTERNATIVES; // the server will say if that is too many
    }
    clearError();
    applySettings();
    const params = new URLSearchParams(window.location.search);
    const settings = state.settings;
    fillSources(params.get("source") || (settings.language && settings.language.source.code) || "auto");
    const targets = targetsOf($("source").value);
    const english = targets.includes(PIVOT) && $("source").value !== PIVOT;
    const preferred = params.get("target") || (english ? PIVOT : settings.language.target.code);
    fillTargets(preferred);
    if (params.has("q")) $("source-text").value = params.get("q");
    autosize();
    updateCount();
    $("app").dataset.state = "idle";
    if ($("source-text").value.trim()) translate();
    else syncUrl();
  }

  function applySettings() {
    const s = state.settings;
    $("key-row").hidden = !s.apiKeys;
    $("api-key").required = Boolean(s.keyRequired);
    $("key-required").textContent = s.keyRequired ? "(required)" : "(optional)";
    if (s.keyRequired) $("api-key").setAttribute("aria-required", "true");
    try {
      $("api-key").value = window.localStorage.getItem("translator.apiKey") || "";
    } catch (_) {
      // storage may be off; the key is typed each time then
    }
    $("suggest-open").hidden = !s.suggestions;
    $("alternatives-control").hidden = state.maxAlternatives < 1;
    const list = formats();
    $("file-input").accept = list.join(",");
    $("file-formats").textContent = list.length ? `Formats: ${list.join(", ")}` : "";
    $("dropzone").closest("section").hidden = !s.filesTranslation;
  }

  function init() {
    const box = $("source-text");
    box.addEventListener("input", () => {
      autosize();
      updateCount();
      highlightSource([]);
      $("align-info").textContent = "";
      schedule();
    });
    box.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
        event.preventDefault();
        translate();
      }
    });
    for (const type of ["keyup", "click", "select"]) box.addEventListener(type, updateViewerLink);
    $("source").addEventListener("change", onSourceChange);
    $("target").addEventListener("change", () => translate());
    $("swap").addEventListener("click", swap);
    $("clear").addEventListener("click", () => {
      box.value = "";
      autosize();
      translate();
      box.focus();
    });
    $("copy").addEventListener("click", copy);
    $("want-alternatives").addEventListener("change", () => translate());
    $("suggest-open").addEventListener("click", openSuggestion);
    $("suggest-form").addEventListener("submit", sendSuggestion);
    $("suggest-cancel").addEventListener("click", () => {
      $("suggest-form").hidden = true;
      $("suggest-open").focus();
    });
    $("key-row").addEventListener("submit", (event) => {
      event.preventDefault();
      $("api-key").dispatchEvent(new Event("change"));
    });
    $("api-key").addEventListener("change", () => {
      try {
        window.localStorage.setItem("translator.apiKey", $("api-key").value.trim());
      } catch (_) {
        // not kept then
      }
      translate();
    });

    const out = $("translation");
    out.addEventListener("pointerenter", ensureAlignment);
    out.addEventListener("focus", ensureAlignment);
    out.addEventListener("pointerover", (event) => {
      const word = wordOf(event.target);
      if (!word) return;
      state.hovered = word;
      refreshHighlight();
    });
    out.addEventListener("pointerleave", () => {
      state.hovered = null;
      refreshHighlight();
    });
    out.addEventListener("click", (event) => {
      const word = wordOf(event.target);
      if (!word || !window.getSelection().isCollapsed) return;
      const same = state.selected && state.selected.s === word.s && state.selected.w === word.w;
      state.selected = same ? null : word;
      refreshHighlight();
    });
    out.addEventListener("keydown", (event) => {
      const keys = { ArrowRight: 1, ArrowDown: 1, ArrowLeft: -1, ArrowUp: -1, Home: "first", End: "last" };
      if (event.key in keys) {
        event.preventDefault();
        ensureAlignment();
        moveSelection(keys[event.key]);
      } else if (event.key === "Escape") {
        state.selected = null;
        refreshHighlight();
      }
    });
    document.addEventListener("selectionchange", () => {
      if (!state.result) return;
      const sel = window.getSelection();
      const inside = Boolean(sel && !sel.isCollapsed && out.contains(sel.anchorNode));
      if (inside) {
        ensureAlignment();
        state.hovered = null;
      }
      if (inside || state.textSelection) refreshHighlight();
      state.textSelection = inside;
    });

    setupDropzone();
    load();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
