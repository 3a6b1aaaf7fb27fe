"""Who may use the gateway and how: TLS, API keys bound to namespaces and scopes, rate limits."""
