"""ridethrough.detectors"""
