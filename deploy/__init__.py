"""Launching a cluster: its configuration (config), `kvferry up` as local processes (local), on Ray
(ray_launch), and the scaling algorithm both share (scaling)."""
