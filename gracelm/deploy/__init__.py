"""`gracelm deploy`: a systemd unit or Kubernetes manifests made from `gracelm serve`'s own options."""
