// Drives the talk page at URL with Debian's Chromium (headless) and records, through WebAudio, what the page plays.
// Usage: node talk_page.mjs URL OUT_DIR
// Writes OUT_DIR/<mode>.json for each mode: "webrtc" (the page's default, with the fake microphone on) and
// "no-webrtc" (RTCPeerConnection removed before the page loads: the page must fall back to the WebSocket).
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { launchChromium } from "./chromium.mjs";

const [url, outDir] = process.argv.slice(2);
const SENTENCE = "The quick brown fox jumps over the lazy dog. It ran into the forest and was gone.";
const TIMEOUT_MS = 30000;
const QUIET_MS = 800; // the page has played everything once it has been quiet this long after session.done

const browser = await launchChromium(["--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream"]);

async function run(mode) {
  const page = await browser.newPage();
  const console = [];
  page.on("console", (message) => console.push(`${message.type()}: ${message.text()}`));
  page.on("pageerror", (error) => console.push(`pageerror: ${error.message}`));
  if (mode === "no-webrtc") {
    await page.addInitScript(() => {
      delete window.RTCPeerConnection;
    });
  }
  await page.goto(url);
  await page.waitForFunction(() => document.getElementById("voice").options.length > 0, null, { timeout: TIMEOUT_MS });
  if (mode === "webrtc") await page.check("#microphone");
  await page.fill("#text", SENTENCE);
  // Connect first, so the recorder is in place before any audio plays; Speak then uses this connection.
  await page.evaluate(() => window.omnigate.connect());
  await page.evaluate(() => {
    const talk = window.omnigate;
    const recorder = talk.audioContext.createScriptProcessor(4096, 1, 1);
    const chunks = [];
    recorder.onaudioprocess = (event) => chunks.push(new Float32Array(event.inputBuffer.getChannelData(0)));
    talk.analyser.connect(recorder); // an AnalyserNode passes its input through unchanged
    recorder.connect(talk.audioContext.destination); // a ScriptProcessor runs only while connected
    window.recorded = chunks;
  });
  await page.click("#speak");
  await page.waitForFunction(
    (quietMs) => {
      const stats = window.omnigate.stats;
      return stats.utterancesDone >= 1 && stats.lastAudibleMs !== null && performance.now() - stats.lastAudibleMs > quietMs;
    },
    QUIET_MS,
    { timeout: TIMEOUT_MS },
  );
  const result = await page.evaluate(() => {
    const talk = window.omnigate;
    const floats = window.recorded;
    const total = floats.reduce((n, chunk) => n + chunk.length, 0);
    const pcm = new Int16Array(total);
    let offset = 0;
    for (const chunk of floats) {
      for (const s of chunk) pcm[offset++] = Math.max(-32768, Math.min(32767, Math.round(s * 32767)));
    }
    const bytes = new Uint8Array(pcm.buffer);
    let binary = "";
    for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
    return {
      transport: document.getElementById("transport").textContent,
      state: document.getElementById("state").textContent,
      sampleRate: talk.audioContext.sampleRate,
      pcm: btoa(binary),
      stats: talk.stats,
    };
  });
  await page.close();
  writeFileSync(join(outDir, `${mode}.json`), JSON.stringify({ mode, ...result, console }));
}

try {
  for (const mode of ["webrtc", "no-webrtc"]) await run(mode);
} finally {
  await browser.close();
}
