"""mixprec.data"""
