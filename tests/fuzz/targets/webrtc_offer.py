"""``POST /v1/realtime/calls``: SDP offers, mutated line by line from a browser's offer.

Only malformed offers are generated (every mutation breaks a line the answer needs, or the body is not an offer at
all), so no call starts ICE; the route must refuse each one typed.
"""

from __future__ import annotations

import httpx
from hypothesis import strategies as st

from tests.fuzz.harness import HttpRequest, HttpTarget

BROWSER_OFFER = "\r\n".join(
    [
        "v=0",
        "o=- 4611731400430051336 2 IN IP4 127.0.0.1",
        "s=-",
        "t=0 0",
        "a=group:BUNDLE 0 1",
        "a=msid-semantic: WMS",
        "m=audio 9 UDP/TLS/RTP/SAVPF 111 0 8",
        "c=IN IP4 0.0.0.0",
        "a=rtcp:9 IN IP4 0.0.0.0",
        "a=ice-ufrag:fuzz",
        "a=ice-pwd:fuzzfuzzfuzzfuzzfuzzfuzz",
        "a=fingerprint:sha-256 " + ":".join(["AB"] * 32),
        "a=setup:actpass",
        "a=mid:0",
        "a=sendrecv",
        "a=rtcp-mux",
        "a=rtpmap:111 opus/48000/2",
        "a=fmtp:111 minptime=10;useinbandfec=1",
        "a=rtpmap:0 PCMU/8000",
        "a=rtpmap:8 PCMA/8000",
        "m=application 9 UDP/DTLS/SCTP webrtc-datachannel",
        "c=IN IP4 0.0.0.0",
        "a=mid:1",
        "a=sctp-port:5000",
        "",
    ]
)
_LINES = BROWSER_OFFER.split("\r\n")
# Mutations that leave no audio section the server may send on, or no parseable SDP at all.
_BREAKING = [
    lambda lines: [line for line in lines if not line.startswith("m=audio")],
    lambda lines: [line.replace("a=sendrecv", "a=sendonly") for line in lines],
    lambda lines: [line.replace("a=sendrecv", "a=inactive") for line in lines],
    lambda lines: [line.replace("m=audio 9", "m=audio x") for line in lines],
    lambda lines: [line.replace("m=audio", "m=video") for line in lines],
    lambda lines: ["v=0", "s=-"],
    lambda lines: [line.replace("=", "") for line in lines],
]


@st.composite
def offers(draw: st.DrawFn) -> tuple[dict[str, str], bytes]:
    kind = draw(st.sampled_from(["mutated", "garbage", "invalid_utf8", "wrong_type", "huge", "empty"]))
    headers = {"content-type": "application/sdp"}
    if kind == "mutated":
        lines = draw(st.sampled_from(_BREAKING))(list(_LINES))
        junk = draw(st.lists(st.text(max_size=30), max_size=3))
        return headers, "\r\n".join(lines + junk).encode("utf-8")
    if kind == "garbage":
        return headers, draw(st.text(max_size=200)).encode("utf-8")
    if kind == "invalid_utf8":
        return headers, BROWSER_OFFER.encode() + b"\xff\xfe"
    if kind == "wrong_type":
        return {"content-type": draw(st.sampled_from(["application/json", "text/plain", ""]))}, BROWSER_OFFER.encode()
    if kind == "huge":
        return headers, b"a=x\r\n" * 20_000
    return headers, b""


class WebRtcOfferTarget(HttpTarget):
    name = "webrtc-offer"
    path = "/v1/realtime/calls"

    def requests(self) -> st.SearchStrategy[tuple[dict[str, str], bytes]]:
        return offers()

    def allowed_statuses(self) -> frozenset[int]:
        return frozenset({400, 413, 415})

    def regressions(self) -> list[list[HttpRequest]]:
        # aiortc's SDP parser raises AssertionError on a media line without a numeric port (once an HTTP 500).
        return [[({"content-type": "application/sdp"}, BROWSER_OFFER.replace("m=audio 9", "m=audio x").encode())]]

    async def probe(self, client: httpx.AsyncClient) -> None:
        r = await client.post(self.path, content=b"v=0", headers={"content-type": "application/sdp"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_offer", r.text[:200]


TARGET = WebRtcOfferTarget()
