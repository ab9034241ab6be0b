"""Redis' password reaches the limiter from a file (a mounted Secret), never from the URL
the gateway's ConfigMap holds."""

from __future__ import annotations

from pathlib import Path

from servefleet.api.gateway_config import GatewayConfig
from servefleet.gateway.limits_failover import FailoverLimiter
from servefleet.gateway.metrics import GatewayMetrics
from servefleet.gateway.route_table import make_limiter


def test_the_password_file_is_sent_as_redis_auth(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("s3cret-from-the-chart\n")
    config = GatewayConfig.model_validate(
        {"redis": {"url": "redis://redis.sys.svc:6379/0", "password": {"file": str(secret)}}}
    )
    limiter = make_limiter(config, GatewayMetrics(), lambda: 0.0)
    assert isinstance(limiter, FailoverLimiter)
    kwargs = limiter.primary.client.connection_pool.connection_kwargs
    assert kwargs["password"] == "s3cret-from-the-chart"
    assert "s3cret" not in config.redis.url  # type: ignore[union-attr]
    plain = GatewayConfig.model_validate({"redis": {"url": "redis://redis.sys.svc:6379/0"}})
    limiter = make_limiter(plain, GatewayMetrics(), lambda: 0.0)
    assert isinstance(limiter, FailoverLimiter)
    assert limiter.primary.client.connection_pool.connection_kwargs.get("password") is None
