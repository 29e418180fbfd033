// Drives the video page at URL with Debian's Chromium (headless): one short generation per transport, counting the
// frames the <video> element presents at the generation's size. A run is over once video.done has arrived and the
// element has presented a few frames of that size; over MSE, also once the element has played the clip to its end
// (a WebRTC track has no end: the call stays open for the next generation).
// Usage: node video_page.mjs URL OUT_DIR
// Writes OUT_DIR/<transport>.json for each transport: "mse" (WebSocket, fragmented MP4 into Media Source
// Extensions) and "webrtc" (a video track of a WebRTC call).
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { launchChromium } from "./chromium.mjs";

const [url, outDir] = process.argv.slice(2);
// 96x64: the tiny preset's default size is 64x64, which a WebRTC call's track shows (black) before any generation.
const CLIP = { width: "96", height: "64", num_frames: "17", fps: "8", steps: "2", seed: "1" };
const TIMEOUT_MS = 60000;
// Frames presented at the clip's size before the run counts as played.
const MIN_PRESENTED = 3;

const browser = await launchChromium();

async function run(transport) {
  const page = await browser.newPage();
  const console = [];
  page.on("console", (message) => console.push(`${message.type()}: ${message.text()}`));
  page.on("pageerror", (error) => console.push(`pageerror: ${error.message}`));
  await page.goto(url);
  for (const [field, value] of Object.entries(CLIP)) await page.fill(`#${field}`, value);
  await page.selectOption("#transport", transport);
  // Count every frame the element presents, whatever its source, from before the generation starts.
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
  await page.click("#generate");
  let result;
  try {
    await page.waitForFunction(
      ({ width, height, minimum, toTheEnd }) => {
        const done = window.omnigateVideo.events.some((event) => event.type === "video.done");
        const atSize = window.presented.filter(([w, h]) => w === width && h === height).length;
        return done && atSize >= minimum && (!toTheEnd || document.getElementById("player").ended);
      },
      { width: Number(CLIP.width), height: Number(CLIP.height), minimum: MIN_PRESENTED, toTheEnd: transport === "mse" },
      { timeout: TIMEOUT_MS },
    );
  } finally {
    result = await page.evaluate(() => {
      const player = document.getElementById("player");
      const quality = player.getVideoPlaybackQuality();
      return {
        events: window.omnigateVideo.events,
        presented: window.presented,
        totalVideoFrames: quality.totalVideoFrames,
        ended: player.ended,
        videoWidth: player.videoWidth,
        videoHeight: player.videoHeight,
        state: document.getElementById("state").textContent,
        error: document.getElementById("error").textContent,
      };
    });
    writeFileSync(join(outDir, `${transport}.json`), JSON.stringify({ transport, ...result, console }));
    await page.close();
  }
}

try {
  for (const transport of ["mse", "webrtc"]) await run(transport);
} finally {
  await browser.close();
}
