/* sha256 stub */
