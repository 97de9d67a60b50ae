"""The HTTP server: the process's start and stop (`api_server.py`), the app put together from one router per
group of routes (`app.py`), the guards every request crosses, the Batch API's routes and the status page."""
