"""The crawl that tests/workflows/test_gateway_scrapy.py runs: a site's pages, through a gateway.

Run as users run a spider (`scrapy runspider`), in a process of its own: the
test's worker keeps serving the pool meanwhile, and Twisted's reactor
cannot be started twice in the test's process. GatewayMiddleware takes the
gateway, the password and the API from the environment and `-s` settings.
The pages come from PAGES_ORIGIN (`/page/0` .. `/page/<PAGES_COUNT - 1>`);
each page's answer is an item, and the crawl's stats are written to
PAGES_STATS when it closes.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import urlsplit

import scrapy
from scrapy.http import Response

from proxy_operator.scrapy import SESSION_META


class PagesSpider(scrapy.Spider):
    name = "pages"
    custom_settings = {  # noqa: RUF012  (Scrapy reads it as a class attribute)
        "DOWNLOADER_MIDDLEWARES": {"proxy_operator.scrapy.GatewayMiddleware": 610},
        "PROXY_OPERATOR_BAN_PATTERN": r"solve this captcha",
        "LOG_LEVEL": "DEBUG",
        # A member being replaced may refuse a tunnel for a moment: retried, not lost.
        "RETRY_TIMES": 10,
        "CONCURRENT_REQUESTS_PER_DOMAIN": 4,
        "TELNETCONSOLE_ENABLED": False,
    }

    async def start(self) -> AsyncIterator[scrapy.Request]:
        origin = os.environ["PAGES_ORIGIN"]
        for n in range(int(os.environ["PAGES_COUNT"])):
            yield scrapy.Request(f"{origin}page/{n}")

    def parse(self, response: Response) -> Iterator[dict[str, Any]]:
        yield {
            "path": urlsplit(response.url).path,
            "status": response.status,
            "body": response.text,
            "session": response.meta.get(SESSION_META),
        }

    def closed(self, reason: str) -> None:
        assert self.crawler.stats is not None
        stats = {k: v for k, v in self.crawler.stats.get_stats().items() if isinstance(v, int)}
        with open(os.environ["PAGES_STATS"], "w") as out:
            json.dump({"reason": reason, **stats}, out)
