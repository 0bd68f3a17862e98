"""What a scraper imports to use a gateway: proxy URLs, the control API, Scrapy and HTTP helpers.

Standard library only at import time; `proxy_operator.scrapy` needs Scrapy,
and `proxy_operator.http_clients` imports requests or httpx only when asked
for a session of that library (the `scrapy` extra, or your own install).
See docs/scrapers.md.
"""
