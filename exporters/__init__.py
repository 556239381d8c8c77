"""ridethrough.exporters"""
