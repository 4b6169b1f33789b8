"""Helpers of the reliability campaign: figures recording, subprocess workers, the stress runner."""
