"""Cluster side: placement of draft and target workers (coordinator and autoscaling later)."""
