"""Who may use the server: API keys and client secrets, the authentication middleware, per-key rate and session
limits, the session configuration minted with a client secret, and the browser guard for unauthenticated loopback."""
