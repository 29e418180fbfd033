// The video viewer: one WebSocket to /v1/realtime/video, reused for each generation; fragmented MP4 into MSE.
// Live mode streams until Cancel; "Change prompt" sends video.prompt, and played media is trimmed from the buffer.
"use strict";

const ENDPOINT = "/v1/realtime/video";
const FIELDS = ["width", "height", "num_frames", "fps", "steps", "seed"];
const $ = (id) => document.getElementById(id);

let socket = null;
let generation = null; // {createdAt, expectedFrames, live, segments, queue, binaryCount, done, mediaSource, ...}
// Seconds of played live video kept in the Media Source buffer (the rest is removed: a live stream has no end).
const LIVE_BUFFER_S = 10;

function setState(text) {
  $("state").textContent = text;
}

function setBusy(busy) {
  $("generate").disabled = busy;
  $("cancel").disabled = !busy;
  $("send_prompt").disabled = !(busy && $("live").checked);
}

function connect() {
  if (socket && socket.readyState === WebSocket.OPEN) return Promise.resolve(socket);
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  // A client secret may come in the page's own URL (?token=...), since a browser cannot set WebSocket headers.
  const token = new URLSearchParams(location.search).get("token");
  const query = token ? `?token=${encodeURIComponent(token)}` : "";
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(`${scheme}://${location.host}${ENDPOINT}${query}`);
    ws.binaryType = "arraybuffer";
    ws.onopen = () => {
      socket = ws;
      resolve(ws);
    };
    ws.onerror = () => reject(new Error("could not connect to " + ENDPOINT));
    ws.onmessage = (message) => {
      if (typeof message.data === "string") onEvent(JSON.parse(message.data));
      else onSegment(message.data);
    };
    ws.onclose = (event) => {
      socket = null;
      if (generation && !generation.done) {
        $("error").textContent = `connection closed (${event.code} ${event.reason})`;
        finish();
      }
    };
  });
}

function onEvent(event) {
  window.omnigateVideo.events.push(event);
  if (event.type === "video.start") {
    startPlayback(event);
  } else if (event.type === "video.chunk") {
    if (generation) generation.frames += event.frames;
    $("frames").textContent = `${generation ? generation.frames : event.frames} (chunk ${event.index}, prompt ${event.prompt_id})`;
  } else if (event.type === "video.prompt.updated") {
    setState(`live: prompt ${event.prompt_id} from chunk ${event.chunk_index}`);
  } else if (event.type === "video.done") {
    if (!generation) return;
    generation.done = true;
    const stats = event.stats || {};
    setState(event.status === "completed" ? "done" : event.status);
    if (event.error) $("error").textContent = event.error;
    $("frames").textContent = `${event.frames} of ${generation.expectedFrames}` +
      (stats.total_ms ? ` in ${(stats.total_ms / 1000).toFixed(1)} s` : "");
    pump();
    finish();
  } else if (event.type === "error") {
    $("error").textContent = `${event.code}: ${event.message}`;
    if (generation && !generation.started) {
      generation = null;
      setBusy(false);
      setState("idle");
    }
  }
}

function startPlayback(event) {
  if (!generation) return;
  generation.started = true;
  generation.expectedFrames = event.live ? "live" : event.num_frames;
  generation.live = event.live;
  const length = event.live ? "live" : `${event.num_frames} frames`;
  setState(`generating ${event.width}x${event.height}, ${length} at ${event.fps} fps`);
  if (!window.MediaSource || !MediaSource.isTypeSupported(event.mime)) {
    $("error").textContent = `this browser cannot play ${event.mime}; the stream is still kept for download`;
    return;
  }
  const mediaSource = new MediaSource();
  generation.mediaSource = mediaSource;
  const player = $("player");
  player.src = URL.createObjectURL(mediaSource);
  mediaSource.addEventListener("sourceopen", () => {
    const sourceBuffer = mediaSource.addSourceBuffer(event.mime);
    sourceBuffer.addEventListener("updateend", pump);
    generation.sourceBuffer = sourceBuffer;
    pump();
  }, { once: true });
}

function onSegment(data) {
  if (!generation) return;
  generation.binaryCount += 1;
  // A live stream is not kept for download: it has no end.
  if (!generation.live) generation.segments.push(data);
  generation.queue.push(data);
  generation.bytes += data.byteLength;
  $("bytes").textContent = `${(generation.bytes / 1024).toFixed(1)} KiB`;
  // The first binary message is the init segment; the second holds the first frame.
  if (generation.binaryCount === 2) {
    $("ttff").textContent = `${Math.round(performance.now() - generation.createdAt)} ms`;
    $("player").play().catch(() => {});
  }
  pump();
}

function pump() {
  const g = generation;
  if (!g || !g.sourceBuffer || g.sourceBuffer.updating) return;
  const played = $("player").currentTime;
  if (g.live && played > 2 * LIVE_BUFFER_S && g.sourceBuffer.buffered.length > 0 &&
      g.sourceBuffer.buffered.start(0) < played - 2 * LIVE_BUFFER_S) {
    g.sourceBuffer.remove(0, played - LIVE_BUFFER_S);
  } else if (g.queue.length > 0) {
    g.sourceBuffer.appendBuffer(g.queue.shift());
  } else if (g.done && g.mediaSource.readyState === "open") {
    g.mediaSource.endOfStream();
  }
}

function finish() {
  const g = generation;
  if (g && g.segments.length > 0) {
    const link = $("download");
    if (link.href) URL.revokeObjectURL(link.href);
    link.href = URL.createObjectURL(new Blob(g.segments, { type: "video/mp4" }));
    link.hidden = false;
  }
  setBusy(false);
}

async function generate() {
  $("error").textContent = "";
  $("ttff").textContent = "–";
  $("frames").textContent = "–";
  $("bytes").textContent = "–";
  $("download").hidden = true;
  const request = { type: "video.create", prompt: $("prompt").value };
  for (const name of FIELDS) {
    const value = $(name).value.trim();
    if (value !== "") request[name] = Number(value);
  }
  if ($("live").checked) {
    request.live = true;
    delete request.num_frames;
  }
  setBusy(true);
  setState("connecting");
  let ws;
  try {
    ws = await connect();
  } catch (error) {
    $("error").textContent = error.message;
    setBusy(false);
    setState("idle");
    return;
  }
  generation = {
    createdAt: performance.now(), expectedFrames: 0, live: false, frames: 0, segments: [], queue: [], bytes: 0,
    binaryCount: 0,
    started: false, done: false, mediaSource: null, sourceBuffer: null,
  };
  setState("denoising");
  ws.send(JSON.stringify(request));
}

$("generate").addEventListener("click", generate);
$("cancel").addEventListener("click", () => {
  if (socket) socket.send(JSON.stringify({ type: "video.cancel" }));
});
$("send_prompt").addEventListener("click", () => {
  if (socket) socket.send(JSON.stringify({ type: "video.prompt", prompt: $("next_prompt").value }));
});
