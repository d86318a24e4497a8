"""``python -m services.postfilter``"""

from services.postfilter.worker import main_entry

if __name__ == "__main__":
    main_entry()
