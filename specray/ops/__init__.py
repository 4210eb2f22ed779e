"""Cluster operations: local and cloud launchers, cluster-config and Helm chart validation."""
