"""API keys, client secrets, per-key rate and session limits, and log redaction, with explicit clocks."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from omnigate.gateway.cli.reliability import exposure_problem
from omnigate.gateway.ops.logging import JsonFormatter, SessionContext, redact, session_id_var
from omnigate.gateway.security.credentials import (
    ApiKeys,
    ClientSecretStore,
    SecretRefused,
    StoreFull,
    api_key_hash,
    current_principal,
    key_principal,
    read_api_keys_file,
)
from omnigate.gateway.security.ratelimit import KeyedSessionRegistry, KeyRateLimiter, KeySessionLimitReached
from omnigate.gateway.settings import Settings

OWNER = key_principal(api_key_hash("k"))


def test_keys_are_matched_by_digest_and_identified_without_revealing_them() -> None:
    keys = ApiKeys([api_key_hash("alpha")])
    principal = keys.lookup("alpha")
    assert principal is not None and principal.kind == "api_key"
    assert "alpha" not in principal.id
    assert keys.lookup("beta") is None
    assert not ApiKeys([]).enabled


def test_keys_file_takes_keys_and_digests(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# team a\nplain-key\n\nsha256:{api_key_hash('hashed-key').upper()}\n")
    keys = ApiKeys(read_api_keys_file(path))
    assert keys.lookup("plain-key") is not None and keys.lookup("hashed-key") is not None
    path.write_text("sha256:abc\n")
    with pytest.raises(ValueError, match=":1:"):
        read_api_keys_file(path)


def test_a_client_secret_opens_one_session_before_it_expires() -> None:
    store = ClientSecretStore(max_secrets=10)
    minted = store.mint(OWNER, ttl_s=60.0, now=1000.0, session={"type": "realtime"})
    assert minted.value.startswith("ek_") and minted.expires_at == 1060.0
    checked = store.check(minted.value, now=1001.0)
    assert checked.id == OWNER.id and checked.kind == "client_secret" and checked.session == {"type": "realtime"}
    store.consume(minted.value, now=1001.0)
    with pytest.raises(SecretRefused) as used:
        store.consume(minted.value, now=1002.0)
    assert used.value.code == "client_secret_used"
    late = store.mint(OWNER, ttl_s=60.0, now=1000.0)
    with pytest.raises(SecretRefused) as expired:
        store.check(late.value, now=1060.0)
    assert expired.value.code == "expired_client_secret"
    with pytest.raises(SecretRefused) as unknown:
        store.check("ek_unknown", now=1000.0)
    assert unknown.value.code == "invalid_client_secret"


def test_the_secret_store_is_bounded_and_forgets_expired_secrets() -> None:
    store = ClientSecretStore(max_secrets=2)
    store.mint(OWNER, ttl_s=10.0, now=0.0)
    store.mint(OWNER, ttl_s=20.0, now=0.0)
    with pytest.raises(StoreFull):
        store.mint(OWNER, ttl_s=10.0, now=5.0)
    store.mint(OWNER, ttl_s=10.0, now=10.0)  # the first one expired and made room
    assert len(store) == 2


def test_token_buckets_refill_at_the_rate_and_name_the_wait() -> None:
    limiter = KeyRateLimiter(rate=2.0, burst=2)
    assert limiter.check("a", 0.0) == 0.0
    assert limiter.check("a", 0.0) == 0.0
    assert limiter.check("a", 0.0) == pytest.approx(0.5)
    assert limiter.check("b", 0.0) == 0.0  # keys are independent
    assert limiter.check("a", 0.5) == 0.0


def test_the_rate_limiter_keeps_a_bounded_number_of_keys() -> None:
    limiter = KeyRateLimiter(rate=1.0, burst=1, max_keys=2)
    limiter.check("a", 0.0)
    limiter.check("b", 0.0)
    limiter.check("c", 0.0)
    assert len(limiter) == 2
    limiter.check("d", 100.0)  # every bucket is full again: one of them is dropped, never an empty one
    assert len(limiter) == 2


def test_sessions_per_key_are_capped_and_released() -> None:
    registry = KeyedSessionRegistry(max_sessions=10, max_per_key=2)
    token = current_principal.set(OWNER)
    try:
        first = registry.acquire("ws-speech")
        registry.acquire("ws-speech")
        with pytest.raises(KeySessionLimitReached, match="limit of 2"):
            registry.acquire("http-speech")
        assert registry.refused_total["key_limit"] == 1
        first.release()
        registry.acquire("ws-speech")
        assert registry.active_for(OWNER.id) == 2
    finally:
        current_principal.reset(token)
    # Without a principal (auth off) only the process cap applies.
    for _ in range(5):
        registry.acquire("ws-speech")
    assert registry.total_active == 7


def test_credentials_are_masked_in_log_lines() -> None:
    line = (
        "GET /v1/realtime?model=x&token=ek_abcdefghijkl HTTP/1.1 Authorization: Bearer sk-123 "
        "openai-insecure-api-key.ek_zzzzzzzzzz"
    )
    cleaned = redact(line)
    assert "abcdefghijkl" not in cleaned and "sk-123" not in cleaned and "zzzzzzzzzz" not in cleaned
    assert "model=x" in cleaned


def test_json_log_lines_carry_the_session_id_and_extra_fields() -> None:
    record = logging.LogRecord(
        "omnigate.test", logging.INFO, __file__, 1, "ended %s", ("?token=ek_secret123456",), None
    )
    record.duration_s = 1.5
    token = session_id_var.set("abc123")
    try:
        assert SessionContext().filter(record)
    finally:
        session_id_var.reset(token)
    body = json.loads(JsonFormatter().format(record))
    assert body["session_id"] == "abc123" and body["duration_s"] == 1.5
    assert "secret123456" not in body["message"]


def test_no_key_on_a_public_address_is_refused_unless_allowed() -> None:
    assert exposure_problem(Settings()) is None
    assert exposure_problem(Settings(host="::1")) is None
    assert exposure_problem(Settings(host="0.0.0.0")) is not None
    assert exposure_problem(Settings(host="0.0.0.0", allow_unauthenticated_public=True)) is None
    assert exposure_problem(Settings(host="0.0.0.0", api_key_hashes=(api_key_hash("k"),))) is None


def test_one_key_cannot_take_every_secret_and_expired_ones_are_swept_on_use() -> None:
    other = key_principal(api_key_hash("other"))
    store = ClientSecretStore(max_secrets=10, max_per_key=2)
    first = store.mint(OWNER, ttl_s=10.0, now=0.0)
    store.mint(OWNER, ttl_s=20.0, now=0.0)
    with pytest.raises(StoreFull, match="this API key"):
        store.mint(OWNER, ttl_s=10.0, now=1.0)
    store.mint(other, ttl_s=10.0, now=1.0)  # another tenant is not locked out
    # A check after the first one expired sweeps it, with no mint needed, and frees its key's slot.
    with pytest.raises(SecretRefused):
        store.check(first.value, now=10.0)
    assert len(store) == 2 and store.outstanding(OWNER.id) == 1
    store.mint(OWNER, ttl_s=10.0, now=10.0)


def test_a_used_secret_no_longer_holds_its_session() -> None:
    store = ClientSecretStore(max_secrets=10)
    minted = store.mint(OWNER, ttl_s=60.0, now=0.0, session={"type": "realtime", "instructions": "x" * 10_000})
    assert store.consume(minted.value, now=1.0).session is not None
    assert all(record.session is None for record in store._records.values())
