"""What the server tells about itself: Prometheus metrics, their multiprocess files and the periodic stats
log line."""
