"""Squid itself: its config rendered, the process run, /proc read.

Every provider's proxies, the gateway and its router run the same Squid, so
what they share sits here, below all of them: `conf` renders squid.conf and
the htpasswd, a proxy's and the gateway's (`htpasswd` hashes the password),
`gateway` names what the gateway's Squid, its router and its metrics agree
on, `process` starts, waits on and stops Squid on this machine, `procfs`
reads processes from /proc. It imports the
standard library and the client's username grammar (proxy_operator.username)
alone: nothing of providers, the gateway, workflows or activities.
"""
