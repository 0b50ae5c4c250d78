"""What travels between the server and the workers: how the records of several clients share one
Flower message (records), the grid that shows a strategy one node per client (grid), and the
audit of what a reply carries off a device (audit)."""
