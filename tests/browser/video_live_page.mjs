// Drives the video page's live mode at URL with Debian's Chromium (headless), once per transport: start a live
// stream, wait until the <video> element presents frames of its size, type a new prompt and send it while it
// plays, wait for a chunk generated with it, then stop (Cancel) and wait for video.done.
// Usage: node video_live_page.mjs URL OUT_DIR
// Writes OUT_DIR/live-<transport>.json for "mse" and "webrtc".
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { launchChromium } from "./chromium.mjs";

const [url, outDir] = process.argv.slice(2);
const FIELDS = { width: "96", height: "64", fps: "8", steps: "2", seed: "1" };
const TIMEOUT_MS = 60000;
const MIN_PRESENTED = 3;

const browser = await launchChromium();

async function run(transport) {
  const page = await browser.newPage();
  const console = [];
  page.on("console", (message) => console.push(`${message.type()}: ${message.text()}`));
  page.on("pageerror", (error) => console.push(`pageerror: ${error.message}`));
  await page.goto(url);
  for (const [field, value] of Object.entries(FIELDS)) await page.fill(`#${field}`, value);
  await page.check("#live");
  await page.selectOption("#transport", transport);
  await page.evaluate(() => {
    const player = document.getElementById("player");
    const presented = [];
    const onFrame = (_now, metadata) => {
      presented.push([metadata.width, metadata.height]);
      player.requestVideoFrameCallback(onFrame);
    };
    player.requestVideoFrameCallback(onFrame);
    window.presented = presented;
  });
  const seen = (type, test = () => true) =>
    page.waitForFunction(
      ({ type, test }) => window.omnigateVideo.events.some((e) => e.type === type && new Function("e", test)(e)),
      { type, test: `return (${test.toString()})(e);` },
      { timeout: TIMEOUT_MS },
    );
  let result;
  try {
    await page.click("#generate");
    await page.waitForFunction(
      ({ width, height, minimum }) => window.presented.filter(([w, h]) => w === width && h === height).length >= minimum,
      { width: Number(FIELDS.width), height: Number(FIELDS.height), minimum: MIN_PRESENTED },
      { timeout: TIMEOUT_MS },
    );
    await page.fill("#next_prompt", "a grey wolf under the moon");
    await page.click("#send_prompt");
    await seen("video.chunk", (e) => e.prompt_id === 1);
    await page.click("#cancel");
    await seen("video.done");
  } finally {
    result = await page.evaluate(() => ({
      events: window.omnigateVideo.events,
      presented: window.presented,
      state: document.getElementById("state").textContent,
      error: document.getElementById("error").textContent,
      sendPromptDisabled: document.getElementById("send_prompt").disabled,
    }));
    writeFileSync(join(outDir, `live-${transport}.json`), JSON.stringify({ transport, ...result, console }));
    await page.close();
  }
}

try {
  for (const transport of ["mse", "webrtc"]) await run(transport);
} finally {
  await browser.close();
}
