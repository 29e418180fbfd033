// Holds a conversation on the talk page's talk mode with Debian's Chromium (headless): the fake microphone plays
// MICROPHONE_WAV, the server's responder answers, and what the page plays is recorded through WebAudio.
// Usage: node talk_mode_page.mjs URL OUT_DIR MICROPHONE_WAV
// Writes OUT_DIR/talk-<mode>.json for each mode: "webrtc" (the page's default) and "no-webrtc" (RTCPeerConnection
// removed before the page loads: the page must talk over WS /v1/realtime).
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { launchChromium } from "./chromium.mjs";

const [url, outDir, microphone] = process.argv.slice(2);
const TIMEOUT_MS = Number(process.env.TALK_TIMEOUT_MS ?? 60000); // per wait
const QUIET_MS = 800; // the reply has played out once the page has been quiet this long after response.done

const browser = await launchChromium([
  "--use-fake-ui-for-media-stream",
  "--use-fake-device-for-media-stream",
  `--use-file-for-fake-audio-capture=${microphone}`,
]);
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
  await page.waitForSelector("#talk-mode:not([hidden])", { timeout: TIMEOUT_MS });
  await page.evaluate(() => window.omnigate.startTalk());
  await page.waitForFunction(() => window.omnigate.analyser !== null, null, { timeout: TIMEOUT_MS });
  await page.evaluate(() => {
    const talk = window.omnigate;
    const recorder = talk.audioContext.createScriptProcessor(4096, 1, 1);
    const chunks = [];
    recorder.onaudioprocess = (event) => chunks.push(new Float32Array(event.inputBuffer.getChannelData(0)));
    talk.analyser.connect(recorder);
    recorder.connect(talk.audioContext.destination);
    window.recorded = chunks;
  });
  // The user is quiet once heard: the recording loops, and its next question would barge in on an answer still being
  // spoken (over WebRTC an answer lasts as long as it is spoken, and the tiny LLM can talk for minutes).
  await page.waitForFunction(() => window.omnigate.turns.transcripts.length >= 1, null, { timeout: TIMEOUT_MS });
  await page.evaluate(() => {
    for (const track of window.omnigate.microphone.getAudioTracks()) track.enabled = false;
  });
  await page.waitForFunction(
    (quietMs) => {
      const talk = window.omnigate;
      return (
        talk.turns.responses.length >= 1 &&
        talk.stats.lastAudibleMs !== null &&
        performance.now() - talk.stats.lastAudibleMs > quietMs
      );
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
    const shown = [...document.querySelectorAll("#conversation li")].map((li) => [li.dataset.role, li.textContent]);
    const transport = document.getElementById("transport").textContent;
    return { sampleRate: talk.audioContext.sampleRate, pcm: btoa(binary), turns: talk.turns, stats: talk.stats, shown, transport };
  });
  await page.evaluate(() => window.omnigate.stopTalk());
  await page.close();
  writeFileSync(join(outDir, `talk-${mode}.json`), JSON.stringify({ mode, ...result, console }));
}

try {
  for (const mode of ["webrtc", "no-webrtc"]) await run(mode);
} finally {
  await browser.close();
}
