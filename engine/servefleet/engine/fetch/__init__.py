"""Model downloads into a cache folder: the work of the engine pod's init container.

`fetch_model` downloads one `ModelSource` (Hugging Face, S3-compatible, plain HTTP) into
`<cache>/<source.cache_entry()>`, atomically and under a lock, logging `FetchProgress`
lines; `fetch_until_done` retries it. In the engine room because it ships in the engine
image and needs nothing of the control plane (no Kubernetes client: progress leaves the
pod as log lines).
"""

from servefleet.engine.fetch.errors import FetchError
from servefleet.engine.fetch.fetcher import FetchResult, fetch_model, fetch_until_done

__all__ = ["FetchError", "FetchResult", "fetch_model", "fetch_until_done"]
