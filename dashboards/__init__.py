"""ridethrough.dashboards"""
