"""Open-loop locust load tests, rate sweeps, goodput and plots (built in a later issue)."""
