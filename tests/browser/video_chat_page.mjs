// Drives the video chat page at URL with Debian's Chromium (headless) and its fake camera and microphone (the Y4M
// and WAV files given): starts the call, waits for the answer to a spoken question (the WAV's tone burst, ended by
// the server VAD), then asks a typed one and waits for its answer. Writes OUT_DIR/run.json.
// Usage: node video_chat_page.mjs URL OUT_DIR CAMERA.y4m MICROPHONE.wav
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { launchChromium } from "./chromium.mjs";

const [url, outDir, camera, microphone] = process.argv.slice(2);
const TIMEOUT_MS = 60000;

const browser = await launchChromium([
  "--use-fake-device-for-media-stream",
  "--use-fake-ui-for-media-stream",
  `--use-file-for-fake-video-capture=${camera}`,
  `--use-file-for-fake-audio-capture=${microphone}`,
]);
const page = await browser.newPage();
const console = [];
page.on("console", (message) => console.push(`${message.type()}: ${message.text()}`));
page.on("pageerror", (error) => console.push(`pageerror: ${error.message}`));
let result = {};
try {
  await page.goto(url);
  await page.click("#start");
  await page.waitForFunction(() => document.getElementById("state").textContent === "connected", null, {
    timeout: TIMEOUT_MS,
  });
  // A spoken question first: the fake microphone's tone burst, ended by the server VAD.
  await page.waitForFunction(
    () => window.omnigateVideoChat.events.some((e) => e.type === "response.audio.done" && e.query_id === 0),
    null,
    { timeout: TIMEOUT_MS },
  );
  // Then a typed one, by when the camera has been streaming for seconds.
  await page.fill("#question", "What is moving?");
  await page.click("#ask");
  await page.waitForFunction(
    () => window.omnigateVideoChat.events.some((e) => e.type === "response.audio.done" && e.query_id === 1),
    null,
    { timeout: TIMEOUT_MS },
  );
} finally {
  result = await page.evaluate(async () => {
    const preview = document.getElementById("preview");
    let audioBytes = 0;
    const pc = window.omnigateVideoChat.pc;
    if (pc) {
      for (const report of (await pc.getStats()).values()) {
        if (report.type === "inbound-rtp" && report.kind === "audio") audioBytes += report.bytesReceived;
      }
    }
    return {
      events: window.omnigateVideoChat.events,
      captions: document.getElementById("captions").textContent,
      previewWidth: preview.videoWidth,
      previewHeight: preview.videoHeight,
      audioBytes,
      state: document.getElementById("state").textContent,
      error: document.getElementById("error").textContent,
    };
  });
  writeFileSync(join(outDir, "run.json"), JSON.stringify({ ...result, console }));
  await browser.close();
}
