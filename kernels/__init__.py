"""Scan, conv and norm ops."""
