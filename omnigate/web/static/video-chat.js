// Live video chat over WebRTC: camera and microphone tracks to POST /v1/video/chat/calls, the answer's speech on the
// call's audio track, its text and the other events on the "video-chat" data channel (the WebSocket route's events).
"use strict";

const $ = (id) => document.getElementById(id);
const state = { events: [], pc: null, channel: null, stream: null };
window.omnigateVideoChat = state;

function setState(text) {
  $("state").textContent = text;
}

function showError(text) {
  $("error").textContent = text;
}

function onEvent(event) {
  state.events.push(event);
  const captions = $("captions");
  if (event.type === "response.start") {
    captions.textContent = "";
    setState("answering");
  } else if (event.type === "response.text.delta") {
    captions.textContent += event.delta;
  } else if (event.type === "response.audio.done" || (event.type === "response.text.done" && event.status !== "completed")) {
    setState("connected");
  } else if (event.type === "error") {
    showError(`${event.code}: ${event.message}`);
  }
}

async function token() {
  const fromUrl = new URLSearchParams(location.search).get("token");
  if (fromUrl) return fromUrl;
  const config = await (await fetch("/web/config.json")).json();
  if (!config.token_url) return null;
  const body = await (await fetch(config.token_url, { method: "POST" })).json();
  return body.value ?? body.client_secret?.value ?? null;
}

function gathered(pc) {
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    pc.addEventListener("icegatheringstatechange", () => {
      if (pc.iceGatheringState === "complete") resolve();
    });
  });
}

function microphoneOn(on) {
  for (const track of state.stream?.getAudioTracks() ?? []) track.enabled = on;
}

async function start() {
  showError("");
  setState("connecting");
  $("start").disabled = true;
  try {
    state.stream = await navigator.mediaDevices.getUserMedia({ video: { width: 640, height: 480 }, audio: true });
    $("preview").srcObject = state.stream;
    const pc = new RTCPeerConnection();
    state.pc = pc;
    for (const track of state.stream.getTracks()) pc.addTrack(track, state.stream);
    pc.addEventListener("track", (event) => {
      $("answer").srcObject = event.streams[0] ?? new MediaStream([event.track]);
    });
    const channel = pc.createDataChannel("video-chat");
    state.channel = channel;
    channel.addEventListener("message", (message) => onEvent(JSON.parse(message.data)));
    channel.addEventListener("open", () => {
      channel.send(JSON.stringify({ type: "session.config", modalities: ["text", "audio"] }));
      setState("connected");
      $("ask").disabled = false;
      $("stop").disabled = false;
      $("talk").disabled = !$("ptt").checked;
    });
    channel.addEventListener("close", () => setState("closed"));
    await pc.setLocalDescription(await pc.createOffer());
    await gathered(pc);
    const secret = await token();
    const headers = { "content-type": "application/sdp" };
    if (secret) headers.authorization = `Bearer ${secret}`;
    const response = await fetch("/v1/video/chat/calls", { method: "POST", body: pc.localDescription.sdp, headers });
    if (response.status !== 201) {
      const body = await response.json().catch(() => ({}));
      throw new Error(body.error?.message ?? `the call was refused (${response.status})`);
    }
    await pc.setRemoteDescription({ type: "answer", sdp: await response.text() });
    microphoneOn(!$("ptt").checked);
  } catch (error) {
    showError(String(error.message ?? error));
    stop();
  }
}

function stop() {
  if (state.channel?.readyState === "open") state.channel.send(JSON.stringify({ type: "video.done" }));
  state.pc?.close();
  for (const track of state.stream?.getTracks() ?? []) track.stop();
  state.pc = state.channel = state.stream = null;
  $("start").disabled = false;
  $("stop").disabled = $("ask").disabled = $("talk").disabled = true;
  setState("idle");
}

function ask() {
  const text = $("question").value.trim();
  if (!text || state.channel?.readyState !== "open") return;
  state.channel.send(JSON.stringify({ type: "video.query", text }));
}

$("start").addEventListener("click", start);
$("stop").addEventListener("click", stop);
$("ask").addEventListener("click", ask);
$("question").addEventListener("keydown", (event) => {
  if (event.key === "Enter") ask();
});
$("ptt").addEventListener("change", () => {
  $("talk").disabled = !$("ptt").checked || !state.pc;
  microphoneOn(!$("ptt").checked);
});
for (const [type, on] of [["pointerdown", true], ["pointerup", false], ["pointerleave", false]]) {
  $("talk").addEventListener(type, () => {
    if ($("ptt").checked) microphoneOn(on);
  });
}
