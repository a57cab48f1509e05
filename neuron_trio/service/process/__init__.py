"""The process and systemd: signals, sd_notify, the node's identity across starts, download progress."""
