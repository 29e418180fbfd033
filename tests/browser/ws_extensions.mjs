// Opens a WebSocket from Chromium (headless, at its defaults: it offers permessage-deflate) to each URL and reports
// the extensions each handshake negotiated (the empty string: none).
// Usage: node ws_extensions.mjs PAGE_URL WS_URL...
// Prints one JSON object: {WS_URL: extensions, or {"error": why}}.
import { launchChromium } from "./chromium.mjs";

const [pageUrl, ...urls] = process.argv.slice(2);
const TIMEOUT_MS = 20000;

const browser = await launchChromium();
try {
  const page = await browser.newPage();
  await page.goto(pageUrl);
  const negotiated = await page.evaluate(
    ({ urls, timeoutMs }) =>
      Promise.all(
        urls.map(
          (url) =>
            new Promise((resolve) => {
              const ws = new WebSocket(url);
              const timer = setTimeout(() => resolve([url, { error: "no handshake" }]), timeoutMs);
              ws.onopen = () => {
                clearTimeout(timer);
                resolve([url, ws.extensions]);
                ws.close();
              };
              ws.onclose = (event) => {
                clearTimeout(timer);
                resolve([url, { error: `closed before open (${event.code})` }]);
              };
            }),
        ),
      ).then(Object.fromEntries),
    { urls, timeoutMs: TIMEOUT_MS },
  );
  process.stdout.write(JSON.stringify(negotiated));
} finally {
  await browser.close();
}
