"use strict";
// The omnigate talk page. Speaks text over WebRTC (POST /v1/realtime/calls, events on the "speech" data channel,
// audio on the media track), or over the WebSocket speech stream when WebRTC is unavailable or fails. When the
// server answers the user (serve --llm-url: /web/config.json names a responder), its talk mode holds a realtime
// conversation: the microphone in over WebRTC (the OpenAI Realtime protocol on the "oai-events" data channel, the
// reply on the media track), or over WS /v1/realtime without WebRTC; the server's VAD ends each turn.
// window.omnigate exposes the state for scripted use (the browser test reads it).

const $ = (id) => document.getElementById(id);
const CALLS_URL = "/v1/realtime/calls";
const CONFIG_URL = "/web/config.json";
const STREAM_PATH = "/v1/audio/speech/stream";
const REALTIME_PATH = "/v1/realtime";
const REALTIME_RATE = 24000; // pcm16 both ways on /v1/realtime
const AUDIBLE_RMS = 0.01; // about -40 dBFS
const METER_INTERVAL_MS = 20;
const WORDS_PER_SECOND = 6;
const ICE_GATHERING_TIMEOUT_MS = 3000;
const CONNECT_TIMEOUT_MS = 10000;
const LOG_LINES = 50;

const talk = {
  connection: null, // {kind, send(event), close(), stopPlayback()}
  audioContext: null,
  analyser: null,
  remoteStream: null,
  utterance: null, // {sends: [[ms, nonSpaceChars]], reference, waiting}
  stats: { ttfaMs: null, peakRms: 0, audibleFrames: 0, lastAudibleMs: null, utterancesDone: 0, errors: [] },
  responder: null, // from /web/config.json: {transcription: bool} when the server answers the user
  conversation: null, // the talk mode's connection: {kind, send(event), close()}
  microphone: null, // the talk mode's microphone stream
  turns: { transcripts: [], replies: [], responses: [] }, // the talk mode's user transcripts, replies, statuses
};
window.omnigate = talk;

function log(text) {
  const item = document.createElement("li");
  item.textContent = `${new Date().toLocaleTimeString()}  ${text}`;
  const list = $("log");
  list.prepend(item);
  while (list.children.length > LOG_LINES) list.lastChild.remove();
}

function setState(state, transport) {
  $("state").textContent = state;
  $("state").dataset.state = state;
  if (transport !== undefined) $("transport").textContent = transport;
  const live = talk.connection !== null;
  $("cancel").disabled = !live;
  $("hangup").disabled = !live;
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const nonSpace = (text) => text.replace(/\s/g, "").length;

function withTimeout(promise, ms, what) {
  return Promise.race([promise, sleep(ms).then(() => Promise.reject(new Error(`${what} timed out`)))]);
}

// ---- audio: one context, one analyser for the meter and the time to first audio ------------------------------

function audioContext() {
  if (talk.audioContext === null) talk.audioContext = new AudioContext();
  talk.audioContext.resume();
  return talk.audioContext;
}

function meter(source) {
  const analyser = audioContext().createAnalyser();
  analyser.fftSize = 1024;
  source.connect(analyser);
  talk.analyser = analyser;
}

const samples = new Float32Array(1024);
setInterval(() => {
  if (talk.analyser === null) return;
  talk.analyser.getFloatTimeDomainData(samples);
  let sum = 0;
  for (const s of samples) sum += s * s;
  const rms = Math.sqrt(sum / samples.length);
  const db = rms > 0 ? 20 * Math.log10(rms) : -100;
  $("level").style.width = `${Math.max(0, Math.min(100, ((db + 60) / 60) * 100))}%`;
  talk.stats.peakRms = Math.max(talk.stats.peakRms, rms);
  if (rms < AUDIBLE_RMS) return;
  talk.stats.audibleFrames += 1;
  talk.stats.lastAudibleMs = performance.now();
  const utterance = talk.utterance;
  if (utterance !== null && utterance.waiting) {
    utterance.waiting = false;
    const reference = utterance.reference ?? utterance.sends.at(-1)[0];
    talk.stats.ttfaMs = Math.round(performance.now() - reference);
    $("ttfa").textContent = `${talk.stats.ttfaMs} ms`;
  }
}, METER_INTERVAL_MS);

// ---- server events (the same on both transports) --------------------------------------------------------------

function onEvent(event) {
  const utterance = talk.utterance;
  if (event.type === "audio.start") {
    if (utterance !== null && event.sentence_index === 0 && utterance.reference === null) {
      // TTFA counts from the moment the first sentence's text was completely sent.
      const needed = nonSpace(event.sentence_text);
      const sent = utterance.sends.find(([, chars]) => chars >= needed) ?? utterance.sends.at(-1);
      utterance.reference = sent[0];
    }
  } else if (event.type === "session.done") {
    talk.stats.utterancesDone += 1;
    log(`utterance ${event.utterance_index} ${event.status}: ${event.total_sentences} sentence(s)`);
  } else if (event.type === "error") {
    talk.stats.errors.push(event.code);
    log(`error ${event.code}: ${event.message}`);
  }
}

function disconnected(reason) {
  if (talk.connection === null) return;
  talk.connection = null;
  talk.analyser = null;
  log(reason);
  setState("closed");
}

// ---- transports ---------------------------------------------------------------------------------------------

// A gateway with API keys names (in /web/config.json) an endpoint of the operator's app that hands the page a
// short-lived client secret, one per connection; without keys the page connects as it is.
async function clientSecret() {
  const { token_url: tokenUrl } = await (await fetch(CONFIG_URL)).json();
  if (!tokenUrl) return null;
  const response = await fetch(tokenUrl);
  if (!response.ok) throw new Error(`no client secret from ${tokenUrl}: HTTP ${response.status}`);
  const body = await response.json();
  return body.value ?? body.client_secret?.value;
}

async function connectWebRtc(withMicrophone) {
  const pc = new RTCPeerConnection({ iceServers: [] });
  if (withMicrophone && navigator.mediaDevices) {
    const microphone = await navigator.mediaDevices.getUserMedia({ audio: true });
    for (const track of microphone.getAudioTracks()) pc.addTrack(track, microphone);
  } else {
    if (withMicrophone) log("no microphone here (it needs https or localhost); receiving only");
    pc.addTransceiver("audio", { direction: "recvonly" });
  }
  const channel = pc.createDataChannel("speech");
  const opened = new Promise((resolve, reject) => {
    channel.onopen = resolve;
    channel.onclose = () => reject(new Error("the data channel closed"));
  });
  pc.ontrack = (event) => {
    const stream = event.streams[0] ?? new MediaStream([event.track]);
    talk.remoteStream = stream;
    $("player").srcObject = stream; // Chrome feeds a remote stream to WebAudio only while an element plays it
    meter(audioContext().createMediaStreamSource(stream));
  };
  pc.onconnectionstatechange = () => {
    setState(pc.connectionState);
    if (pc.connectionState === "failed" || pc.connectionState === "closed") disconnected(`connection ${pc.connectionState}`);
  };
  try {
    await pc.setLocalDescription(await pc.createOffer());
    // The server answers with all its candidates and takes none later, so the offer carries ours.
    await withTimeout(
      new Promise((resolve) => {
        if (pc.iceGatheringState === "complete") resolve();
        pc.onicegatheringstatechange = () => pc.iceGatheringState === "complete" && resolve();
      }),
      ICE_GATHERING_TIMEOUT_MS,
      "ICE gathering",
    ).catch(() => log("ICE gathering is slow; offering the candidates found so far"));
    const headers = { "content-type": "application/sdp" };
    const secret = await clientSecret();
    if (secret) headers.authorization = `Bearer ${secret}`;
    const response = await fetch(CALLS_URL, { method: "POST", headers, body: pc.localDescription.sdp });
    if (response.status !== 201) throw new Error(`the call was refused: HTTP ${response.status} ${await response.text()}`);
    await pc.setRemoteDescription({ type: "answer", sdp: await response.text() });
    await withTimeout(opened, CONNECT_TIMEOUT_MS, "connecting");
  } catch (error) {
    pc.close();
    throw error;
  }
  channel.onmessage = (event) => onEvent(JSON.parse(event.data));
  channel.onclose = () => disconnected("the data channel closed");
  return {
    kind: "WebRTC",
    send: (event) => channel.send(JSON.stringify(event)),
    close: () => pc.close(),
    stopPlayback: () => {}, // the server's next frame after input.cancel is silence
  };
}

async function connectWebSocket() {
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const secret = await clientSecret();
  const protocols = secret ? [`openai-insecure-api-key.${secret}`] : [];
  const ws = new WebSocket(`${scheme}://${location.host}${STREAM_PATH}`, protocols);
  ws.binaryType = "arraybuffer";
  await withTimeout(
    new Promise((resolve, reject) => {
      ws.onopen = resolve;
      ws.onerror = () => reject(new Error("the WebSocket failed"));
    }),
    CONNECT_TIMEOUT_MS,
    "connecting",
  );
  const context = audioContext();
  const output = context.createGain();
  output.connect(context.destination);
  meter(output);
  const playing = new Set();
  let sampleRate = 24000;
  let playAt = 0;
  ws.onmessage = (message) => {
    if (typeof message.data === "string") {
      const event = JSON.parse(message.data);
      if (event.type === "audio.start") sampleRate = event.sample_rate;
      onEvent(event);
      return;
    }
    const pcm = new Int16Array(message.data);
    const buffer = context.createBuffer(1, pcm.length, sampleRate);
    const channel = buffer.getChannelData(0);
    for (let i = 0; i < pcm.length; i++) channel[i] = pcm[i] / 32768;
    const source = context.createBufferSource();
    source.buffer = buffer;
    source.connect(output);
    playAt = Math.max(playAt, context.currentTime + 0.05);
    source.start(playAt);
    playAt += buffer.duration;
    playing.add(source);
    source.onended = () => playing.delete(source);
  };
  ws.onclose = (event) => disconnected(`the WebSocket closed (${event.code} ${event.reason})`);
  setState("connected");
  return {
    kind: "WebSocket",
    send: (event) => ws.send(JSON.stringify(event)),
    close: () => ws.close(),
    stopPlayback: () => {
      for (const source of playing) source.stop();
      playing.clear();
      playAt = 0;
    },
  };
}

async function connect() {
  const wantRtc = $("transport-choice").value === "auto";
  setState("connecting", "");
  let connection = null;
  if (wantRtc && window.RTCPeerConnection) {
    try {
      connection = await connectWebRtc($("microphone").checked);
    } catch (error) {
      log(`WebRTC failed (${error.message}); using the WebSocket`);
    }
  } else if (wantRtc) {
    log("this browser has no WebRTC; using the WebSocket");
  }
  if (connection === null) connection = await connectWebSocket();
  talk.connection = connection;
  setState("connected", `over ${connection.kind}`);
  const config = { type: "session.config", response_format: "pcm", stream_audio: true };
  if ($("voice").value) config.voice = $("voice").value;
  connection.send(config);
  log(`connected over ${connection.kind}`);
}

// ---- talk mode: a realtime conversation with the server's responder -----------------------------------------

function say(role, text) {
  const item = document.createElement("li");
  item.dataset.role = role;
  item.textContent = text;
  $("conversation").append(item);
}

function onRealtimeEvent(event) {
  const turns = talk.turns;
  if (event.type === "session.created") {
    const session = { type: "realtime", instructions: $("instructions").value };
    if ($("voice").value) session.audio = { output: { voice: $("voice").value } };
    talk.conversation?.send({ type: "session.update", session });
  } else if (event.type === "conversation.item.input_audio_transcription.completed") {
    turns.transcripts.push(event.transcript);
    say("user", event.transcript);
  } else if (event.type === "response.output_audio_transcript.done") {
    turns.replies.push(event.transcript);
    say("assistant", event.transcript);
  } else if (event.type === "response.done") {
    turns.responses.push(event.response.status);
    if (event.response.status === "failed") log(`the reply failed: ${JSON.stringify(event.response.status_details)}`);
  } else if (event.type === "error") {
    talk.stats.errors.push(event.error.code);
    log(`error ${event.error.code}: ${event.error.message}`);
  }
}

// Over WebRTC: the microphone on the media track, events on "oai-events", the reply on the remote track.
async function talkWebRtc(microphone) {
  const pc = new RTCPeerConnection({ iceServers: [] });
  for (const track of microphone.getAudioTracks()) pc.addTrack(track, microphone);
  const channel = pc.createDataChannel("oai-events");
  const opened = new Promise((resolve, reject) => {
    channel.onopen = resolve;
    channel.onclose = () => reject(new Error("the data channel closed"));
  });
  channel.onmessage = (message) => onRealtimeEvent(JSON.parse(message.data));
  pc.ontrack = (event) => {
    const stream = event.streams[0] ?? new MediaStream([event.track]);
    talk.remoteStream = stream;
    $("player").srcObject = stream;
    meter(audioContext().createMediaStreamSource(stream));
  };
  const conversation = {
    kind: "WebRTC",
    send: (event) => channel.readyState === "open" && channel.send(JSON.stringify(event)),
    close: () => pc.close(),
  };
  talk.conversation = conversation;
  pc.onconnectionstatechange = () => {
    if (pc.connectionState === "failed" || pc.connectionState === "closed") stopTalk(`connection ${pc.connectionState}`);
  };
  try {
    await pc.setLocalDescription(await pc.createOffer());
    await withTimeout(
      new Promise((resolve) => {
        if (pc.iceGatheringState === "complete") resolve();
        pc.onicegatheringstatechange = () => pc.iceGatheringState === "complete" && resolve();
      }),
      ICE_GATHERING_TIMEOUT_MS,
      "ICE gathering",
    ).catch(() => log("ICE gathering is slow; offering the candidates found so far"));
    const headers = { "content-type": "application/sdp" };
    const secret = await clientSecret();
    if (secret) headers.authorization = `Bearer ${secret}`;
    const response = await fetch(CALLS_URL, { method: "POST", headers, body: pc.localDescription.sdp });
    if (response.status !== 201) throw new Error(`the call was refused: HTTP ${response.status} ${await response.text()}`);
    await pc.setRemoteDescription({ type: "answer", sdp: await response.text() });
    await withTimeout(opened, CONNECT_TIMEOUT_MS, "connecting");
  } catch (error) {
    pc.onconnectionstatechange = null; // the fallback keeps the microphone
    channel.onclose = null;
    pc.close();
    throw error;
  }
  channel.onclose = () => stopTalk("the data channel closed");
  return conversation;
}

function base64Pcm(pcm) {
  const bytes = new Uint8Array(pcm.buffer, pcm.byteOffset, pcm.byteLength);
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(binary);
}

// Over the WebSocket (no WebRTC here): the microphone as pcm16 appends, the reply from its audio deltas, and on
// barge-in the reply's item is truncated to what was played.
async function talkWebSocket(microphone) {
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const secret = await clientSecret();
  const protocols = ["realtime", ...(secret ? [`openai-insecure-api-key.${secret}`] : [])];
  const ws = new WebSocket(`${scheme}://${location.host}${REALTIME_PATH}`, protocols);
  await withTimeout(
    new Promise((resolve, reject) => {
      ws.onopen = resolve;
      ws.onerror = () => reject(new Error("the WebSocket failed"));
    }),
    CONNECT_TIMEOUT_MS,
    "connecting",
  );
  const context = audioContext();
  const send = (event) => ws.readyState === WebSocket.OPEN && ws.send(JSON.stringify(event));
  const input = context.createMediaStreamSource(microphone);
  const capture = context.createScriptProcessor(4096, 1, 1);
  const step = context.sampleRate / REALTIME_RATE;
  capture.onaudioprocess = (event) => {
    const samples = event.inputBuffer.getChannelData(0);
    const pcm = new Int16Array(Math.floor(samples.length / step));
    for (let i = 0; i < pcm.length; i++) pcm[i] = Math.max(-32768, Math.min(32767, Math.round(samples[Math.floor(i * step)] * 32767)));
    send({ type: "input_audio_buffer.append", audio: base64Pcm(pcm) });
  };
  const silent = context.createGain();
  silent.gain.value = 0; // a ScriptProcessor runs only while connected to the output
  input.connect(capture);
  capture.connect(silent);
  silent.connect(context.destination);
  const output = context.createGain();
  output.connect(context.destination);
  meter(output);
  const playing = new Set();
  let playAt = 0;
  let reply = null; // {itemId, startedAt (context time), ms}
  const stopPlayback = () => {
    if (reply !== null && playing.size > 0) {
      const played = Math.max(0, Math.min(reply.ms, (context.currentTime - reply.startedAt) * 1000));
      send({ type: "conversation.item.truncate", item_id: reply.itemId, content_index: 0, audio_end_ms: Math.floor(played) });
    }
    for (const source of playing) source.stop();
    playing.clear();
    playAt = 0;
    reply = null;
  };
  ws.onmessage = (message) => {
    const event = JSON.parse(message.data);
    if (event.type === "response.output_audio.delta") {
      const bytes = Uint8Array.from(atob(event.delta), (c) => c.charCodeAt(0));
      const pcm = new Int16Array(bytes.buffer, 0, bytes.length >> 1);
      const buffer = context.createBuffer(1, pcm.length, REALTIME_RATE);
      const channel = buffer.getChannelData(0);
      for (let i = 0; i < pcm.length; i++) channel[i] = pcm[i] / 32768;
      const source = context.createBufferSource();
      source.buffer = buffer;
      source.connect(output);
      playAt = Math.max(playAt, context.currentTime + 0.05);
      if (reply === null || reply.itemId !== event.item_id) reply = { itemId: event.item_id, startedAt: playAt, ms: 0 };
      source.start(playAt);
      playAt += buffer.duration;
      reply.ms += buffer.duration * 1000;
      playing.add(source);
      source.onended = () => playing.delete(source);
    } else if (event.type === "input_audio_buffer.speech_started") {
      stopPlayback(); // the user talks over the reply: the server cancels it
    }
    onRealtimeEvent(event);
  };
  const conversation = {
    kind: "WebSocket",
    send,
    close: () => {
      capture.disconnect();
      input.disconnect();
      stopPlayback();
      ws.close();
    },
  };
  talk.conversation = conversation;
  ws.onclose = (event) => stopTalk(`the WebSocket closed (${event.code} ${event.reason})`);
  return conversation;
}

async function startTalk() {
  if (talk.conversation !== null) return;
  if (!navigator.mediaDevices) {
    log("talk mode needs a microphone (https or localhost)");
    return;
  }
  hangup();
  audioContext();
  setState("connecting", "");
  const microphone = await navigator.mediaDevices.getUserMedia({ audio: { echoCancellation: true } });
  talk.microphone = microphone;
  try {
    if (window.RTCPeerConnection) {
      try {
        await talkWebRtc(microphone);
      } catch (error) {
        talk.conversation = null;
        log(`WebRTC failed (${error.message}); using the WebSocket`);
      }
    }
    if (talk.conversation === null) await talkWebSocket(microphone);
  } catch (error) {
    stopTalk(`could not start talking: ${error.message}`);
    return;
  }
  $("talk").disabled = true;
  $("stop-talk").disabled = false;
  setState("connected", `talking over ${talk.conversation.kind}`);
  log("talking: speak now");
}

function stopTalk(reason = "stopped talking") {
  const conversation = talk.conversation;
  const microphone = talk.microphone;
  if (conversation === null && microphone === null) return;
  talk.conversation = null;
  talk.microphone = null;
  talk.analyser = null;
  if (microphone !== null) for (const track of microphone.getTracks()) track.stop();
  if (conversation !== null) conversation.close();
  $("talk").disabled = false;
  $("stop-talk").disabled = true;
  setState("closed", "");
  log(reason);
}

async function loadConfig() {
  try {
    talk.responder = (await (await fetch(CONFIG_URL)).json()).responder ?? null;
  } catch (error) {
    log(`could not read the page's config: ${error.message}`);
  }
  const answers = talk.responder !== null && talk.responder.transcription;
  $("talk-mode").hidden = !answers;
  $("speak-heading").hidden = !answers;
}

// ---- controls -----------------------------------------------------------------------------------------------

async function speak() {
  const text = $("text").value;
  if (!text.trim()) return;
  stopTalk();
  audioContext();
  if (talk.connection === null) await connect();
  const connection = talk.connection;
  const pieces = $("word-by-word").checked ? (text.match(/\S+\s*/g) ?? []) : [text];
  const utterance = { sends: [], reference: null, waiting: true };
  talk.utterance = utterance;
  talk.stats.ttfaMs = null;
  $("ttfa").textContent = "…";
  let chars = 0;
  for (const [index, piece] of pieces.entries()) {
    if (index > 0) await sleep(1000 / WORDS_PER_SECOND);
    if (talk.connection !== connection) return;
    connection.send({ type: "input.text", text: piece });
    chars += nonSpace(piece);
    utterance.sends.push([performance.now(), chars]);
  }
  connection.send({ type: "input.done" });
}

function cancel() {
  if (talk.connection === null) return;
  talk.connection.send({ type: "input.cancel" });
  talk.connection.stopPlayback();
  if (talk.utterance !== null) talk.utterance.waiting = false;
  log("cancelled");
}

function hangup() {
  if (talk.connection === null) return;
  const connection = talk.connection;
  disconnected("hung up");
  connection.close();
}

async function loadVoices() {
  try {
    const response = await fetch("/v1/audio/voices");
    const { voices, default: preferred } = await response.json();
    // OpenAI's voice names are listed too, as aliases (alias_of); they speak with a voice already in the list.
    for (const voice of voices.filter((v) => !v.alias_of)) {
      const option = new Option(voice.name || voice.id, voice.id, false, voice.id === preferred);
      $("voice").add(option);
    }
  } catch (error) {
    log(`could not list voices: ${error.message}`);
  }
}

$("speak").onclick = () => speak().catch((error) => log(`could not speak: ${error.message}`));
$("cancel").onclick = cancel;
$("hangup").onclick = hangup;
$("transport-choice").onchange = hangup;
$("talk").onclick = () => startTalk().catch((error) => stopTalk(`could not start talking: ${error.message}`));
$("stop-talk").onclick = () => stopTalk();
Object.assign(talk, { connect, speak, cancel, hangup, startTalk, stopTalk });
setState("idle", window.RTCPeerConnection ? "" : "(no WebRTC in this browser: WebSocket)");
loadVoices();
loadConfig();
