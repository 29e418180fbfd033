// Debian's Chromium, headless, as the browser tests launch it inside their network namespace.
import { chromium } from "playwright-core";

export function launchChromium(extraArgs = []) {
  return chromium.launch({
    executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
    headless: true,
    args: [
      "--no-sandbox",
      "--disable-gpu",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
      "--no-first-run",
      "--disable-quic",
      "--autoplay-policy=no-user-gesture-required",
      // Offer real host addresses rather than mDNS names (nothing answers mDNS inside the test's namespace).
      "--disable-features=WebRtcHideLocalIpsWithMdns",
      ...extraArgs,
    ],
  });
}
