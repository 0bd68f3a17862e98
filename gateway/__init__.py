"""proxy-operator-gateway: one stable proxy endpoint over a ProxyPool.

See docs/architecture.md, "The gateway".
"""
