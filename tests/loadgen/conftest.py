"""The bench runs against the same real processes as the end-to-end tests: an engine server on the
tiny model and a gateway in front of it; and against gateways that want keys (the security tests'
keys file)."""

from tests.gateway.test_e2e import gateway_address  # noqa: F401  (a fixture)
from tests.security.conftest import keys  # noqa: F401  (a fixture)
