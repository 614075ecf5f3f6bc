"""The review page served by `meshlm review` at `/`: plain HTML, CSS and JS in one string.

Nothing is loaded from elsewhere (the server's CSP forbids it; machines here have no
internet). Model text is shown with textContent only, never parsed as HTML.
Keys: a / b / t / x label (A better, B better, tie, both bad); u or Ctrl+Z undo. A held-down
key does not repeat, and keys are ignored while a request is in flight, so one press is one
label. The reviewer's name comes from ?reviewer=NAME or the name box, kept in localStorage.
"""

PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>meshlm review</title>
<style>
  body { font-family: system-ui, sans-serif; margin: 0; background: #f6f6f4; color: #1c1c1c; }
  header { display: flex; gap: 1em; align-items: baseline; padding: .6em 1.2em;
           background: #26323d; color: #fff; flex-wrap: wrap; }
  header h1 { font-size: 1.1em; margin: 0; }
  header button { font-size: .8em; }
  #progress { font-variant-numeric: tabular-nums; }
  main, #name-form, #done, #message, #controls { margin: 1em 1.2em; }
  section { background: #fff; border: 1px solid #d6d6d0; border-radius: 6px; padding: .4em .9em; }
  h2 { font-size: .9em; text-transform: uppercase; letter-spacing: .05em; color: #666; }
  pre { white-space: pre-wrap; overflow-wrap: anywhere; font: inherit; margin: 0 0 .6em; }
  .pair { display: grid; grid-template-columns: 1fr 1fr; gap: 1em; margin-top: 1em; }
  #controls { display: flex; gap: .6em; flex-wrap: wrap; }
  #controls button { font-size: 1em; padding: .5em 1em; cursor: pointer; }
  kbd { border: 1px solid #aaa; border-radius: 3px; padding: 0 .3em; font-size: .8em; }
  #message { min-height: 1.4em; }
  #message.error { color: #a40000; font-weight: 600; }
  #item-id { color: #888; font-size: .8em; text-transform: none; }
</style>
</head>
<body>
<header>
  <h1>meshlm review</h1>
  <span id="progress" aria-live="polite"></span>
  <span>reviewer: <b id="who"></b></span>
  <button id="switch" type="button">change reviewer</button>
</header>
<form id="name-form" hidden>
  <label>Your name: <input id="name-input" autocomplete="off" maxlength="100" required></label>
  <button id="name-ok" type="submit">Start reviewing</button>
</form>
<main id="review" hidden>
  <section><h2>Prompt <span id="item-id"></span></h2><pre id="prompt"></pre></section>
  <div class="pair">
    <section><h2>Response A</h2><pre id="response-a"></pre></section>
    <section><h2>Response B</h2><pre id="response-b"></pre></section>
  </div>
</main>
<p id="done" hidden>Nothing left to review. Thank you!</p>
<div id="controls" hidden>
  <button type="button" id="btn-A" data-label="A">A is better <kbd>a</kbd></button>
  <button type="button" id="btn-B" data-label="B">B is better <kbd>b</kbd></button>
  <button type="button" id="btn-tie" data-label="tie">Tie <kbd>t</kbd></button>
  <button type="button" id="btn-both_bad" data-label="both_bad">Both bad <kbd>x</kbd></button>
  <button type="button" id="undo">Undo <kbd>u</kbd></button>
</div>
<p id="message" role="alert"></p>
<script>
"use strict";
const KEY = "meshlm-review-reviewer";
const KEYS = {a: "A", b: "B", t: "tie", x: "both_bad"};
const state = {reviewer: null, item: null, busy: false, actions: 0};
const $ = (id) => document.getElementById(id);

async function api(path, body) {
  const init = body === undefined ? {} :
      {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)};
  const response = await fetch("/api/" + path, init);
  let data;
  try { data = await response.json(); } catch (e) { data = {}; }
  if (!response.ok) {
    const error = new Error(data.error || ("HTTP " + response.status));
    error.status = response.status;
    throw error;
  }
  return data;
}

function say(text, isError) {
  $("message").textContent = text;
  $("message").className = isError ? "error" : "";
}

function showProgress(p) {
  $("progress").textContent = p.resolved + " / " + p.total + " resolved \u00b7 yours: " + p.mine;
}

function show(data) {
  state.item = data.item;
  showProgress(data.progress);
  const item = data.item;
  $("review").hidden = !item;
  $("done").hidden = !!item;
  document.body.dataset.itemId = item ? item.item_id : "";
  if (item) {
    $("item-id").textContent = item.item_id;
    $("prompt").textContent = item.prompt;
    $("response-a").textContent = item.response_a;
    $("response-b").textContent = item.response_b;
  }
  for (const b of document.querySelectorAll("#controls [data-label]")) b.disabled = !item;
}

async function run(action) {  // one request at a time: a double press is not a double label
  if (state.busy || !state.reviewer) return;
  state.busy = true;
  state.actions += 1;
  document.body.dataset.busy = "1";
  try {
    await action();
  } catch (e) {
    say(e.message, true);
    if (e.status === 409 || e.status === 404) {  // the item went away: move on to the next one
      try { show(await api("claim", {reviewer: state.reviewer})); } catch (e2) {}
    }
  } finally {
    state.busy = false;
    document.body.dataset.busy = "";
  }
}

function label(value) {
  if (!state.item) return;
  const id = state.item.item_id;
  run(async () => {
    show(await api("submit", {reviewer: state.reviewer, item_id: id, label: value}));
    say("Recorded " + value + " for " + id + ".", false);
  });
}

function undo() {
  run(async () => {
    const data = await api("undo", {reviewer: state.reviewer});
    show(data);
    say(data.undone_label ? "Undid " + data.undone_label + " on " + data.item.item_id + "."
                          : "Nothing to undo.", !data.undone_label);
  });
}

function start(name) {
  state.reviewer = name;
  localStorage.setItem(KEY, name);
  $("who").textContent = name;
  $("name-form").hidden = true;
  $("controls").hidden = false;
  run(async () => show(await api("claim", {reviewer: name})));
}

async function refreshProgress() {  // others' labels show up too; a stale answer is dropped
  if (!state.reviewer || state.busy) return;
  const before = state.actions;
  try {
    const p = await api("progress?reviewer=" + encodeURIComponent(state.reviewer));
    if (state.actions === before && !state.busy) showProgress(p);
  } catch (e) {}
}

function askName() {
  state.reviewer = null;
  $("review").hidden = true;
  $("done").hidden = true;
  $("controls").hidden = true;
  $("name-form").hidden = false;
  $("name-input").focus();
}

document.addEventListener("keydown", (e) => {
  if (e.repeat || e.altKey || e.metaKey || !state.reviewer) return;
  if (e.target instanceof HTMLInputElement) return;
  const key = e.key.toLowerCase();
  if (e.ctrlKey) {
    if (key === "z") { e.preventDefault(); undo(); }
    return;
  }
  if (key === "u") { e.preventDefault(); undo(); }
  else if (KEYS[key]) { e.preventDefault(); label(KEYS[key]); }
});
for (const b of document.querySelectorAll("#controls [data-label]")) {
  b.addEventListener("click", () => label(b.dataset.label));
}
$("undo").addEventListener("click", undo);
$("switch").addEventListener("click", () => { localStorage.removeItem(KEY); askName(); });
$("name-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const name = $("name-input").value.trim();
  if (name) start(name);
});

const fromUrl = new URLSearchParams(location.search).get("reviewer");
const name = (fromUrl || localStorage.getItem(KEY) || "").trim();
if (name) start(name); else askName();
setInterval(refreshProgress, 10000);
</script>
</body>
</html>
"""
