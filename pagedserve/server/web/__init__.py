"""The browser page served at `/`: a live dashboard, a chat playground and the configuration.

Plain HTML/CSS/JS under static/ (no build step; uPlot vendored under static/vendor). The page
itself and its static files carry no data and stay reachable without the API key; the data
routes below (/ui/stats, /ui/config) are behind the key like every /v1 route, so behind
--api-key the page asks for the key before it can show anything.
"""
from pagedserve.server.web.routes import PUBLIC_PREFIX, is_public_request, mount_web_ui

__all__ = ["PUBLIC_PREFIX", "is_public_request", "mount_web_ui"]
