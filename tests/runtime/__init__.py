"""Tests of the serving runtime (marker: runtime)."""
