// A small, strict XML reader for checking generated files (SVG) in tests: elements, attributes
// in double or single quotes, text, comments, the <?xml ...?> declaration and the five
// predefined entities plus numeric references. Anything else (an unclosed or mismatched tag, a
// raw '<' or '&' in text or attributes, a repeated attribute, content after the root) throws
// std::runtime_error naming the offset. No DTDs, CDATA or namespaces beyond plain names.
#pragma once

#include <cctype>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace hp::testing {

struct XmlElement {
  std::string name;
  std::map<std::string, std::string> attrs;
  std::vector<std::unique_ptr<XmlElement>> children;
  std::string text;  // the element's own character data, entities decoded

  // Every element named `name` in this subtree (this element included), in document order.
  void find_all(const std::string& tag, std::vector<const XmlElement*>& out) const {
    if (name == tag) out.push_back(this);
    for (const auto& c : children)
      c->find_all(tag, out);
  }
  std::vector<const XmlElement*> find_all(const std::string& tag) const {
    std::vector<const XmlElement*> out;
    find_all(tag, out);
    return out;
  }
  const XmlElement* child(const std::string& tag) const {
    for (const auto& c : children) {
      if (c->name == tag) return c.get();
    }
    return nullptr;
  }
};

namespace detail {

class XmlReader {
 public:
  explicit XmlReader(const std::string& s) : s_(s) {}

  std::unique_ptr<XmlElement> document() {
    skip_misc();
    if (starts_with("<?xml")) {
      const auto end = s_.find("?>", pos_);
      if (end == std::string::npos) fail("unterminated XML declaration");
      pos_ = end + 2;
      skip_misc();
    }
    if (!starts_with("<")) fail("no root element");
    auto root = element();
    skip_misc();
    if (pos_ != s_.size()) fail("content after the root element");
    return root;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error("XML: " + what + " at offset " + std::to_string(pos_));
  }
  bool starts_with(const char* t) const { return s_.compare(pos_, std::strlen(t), t) == 0; }
  void skip_space() {
    while (pos_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[pos_])))
      ++pos_;
  }
  void skip_misc() {  // whitespace and comments between elements
    for (;;) {
      skip_space();
      if (!starts_with("<!--")) return;
      const auto end = s_.find("-->", pos_);
      if (end == std::string::npos) fail("unterminated comment");
      pos_ = end + 3;
    }
  }
  std::string name() {
    const size_t start = pos_;
    while (pos_ < s_.size() &&
           (std::isalnum(static_cast<unsigned char>(s_[pos_])) || s_[pos_] == '-' ||
            s_[pos_] == '_' || s_[pos_] == ':' || s_[pos_] == '.')) {
      ++pos_;
    }
    if (pos_ == start) fail("expected a name");
    return s_.substr(start, pos_ - start);
  }
  // Character data up to `stop`, entities decoded; a raw '<' (in attributes) or '&' is an error.
  std::string chars(char stop) {
    std::string out;
    while (pos_ < s_.size() && s_[pos_] != stop) {
      const char c = s_[pos_];
      if (c == '<') fail("raw '<' in character data");
      if (c != '&') {
        out += c;
        ++pos_;
        continue;
      }
      const auto semi = s_.find(';', pos_);
      if (semi == std::string::npos || semi - pos_ > 10) fail("raw '&'");
      const std::string ent = s_.substr(pos_ + 1, semi - pos_ - 1);
      static const std::map<std::string, char> named{
          {"lt", '<'}, {"gt", '>'}, {"amp", '&'}, {"quot", '"'}, {"apos", '\''}};
      if (named.count(ent)) {
        out += named.at(ent);
      } else if (ent.size() > 1 && ent[0] == '#') {
        out += '?';  // a numeric reference: valid; its code point does not matter here
      } else {
        fail("unknown entity '&" + ent + ";'");
      }
      pos_ = semi + 1;
    }
    return out;
  }
  std::unique_ptr<XmlElement> element() {
    ++pos_;  // '<'
    auto e = std::make_unique<XmlElement>();
    e->name = name();
    for (;;) {
      const size_t before = pos_;
      skip_space();
      if (starts_with("/>")) {
        pos_ += 2;
        return e;
      }
      if (starts_with(">")) {
        ++pos_;
        break;
      }
      if (pos_ == before) fail("expected whitespace before an attribute");
      const std::string key = name();
      skip_space();
      if (!starts_with("=")) fail("attribute '" + key + "' without '='");
      ++pos_;
      skip_space();
      if (pos_ >= s_.size() || (s_[pos_] != '"' && s_[pos_] != '\'')) {
        fail("attribute '" + key + "' value is not quoted");
      }
      const char quote = s_[pos_++];
      std::string value = chars(quote);
      if (pos_ >= s_.size()) fail("unterminated attribute value");
      ++pos_;
      if (!e->attrs.emplace(key, value).second) fail("repeated attribute '" + key + "'");
    }
    for (;;) {  // content
      e->text += chars('<');
      if (pos_ >= s_.size()) fail("element <" + e->name + "> is not closed");
      if (starts_with("<!--")) {
        const auto end = s_.find("-->", pos_);
        if (end == std::string::npos) fail("unterminated comment");
        pos_ = end + 3;
      } else if (starts_with("</")) {
        pos_ += 2;
        const std::string closing = name();
        if (closing != e->name) fail("</" + closing + "> closes <" + e->name + ">");
        skip_space();
        if (!starts_with(">")) fail("malformed closing tag");
        ++pos_;
        return e;
      } else {
        e->children.push_back(element());
      }
    }
  }

  const std::string& s_;
  size_t pos_ = 0;
};

}  // namespace detail

// Parses a whole document; throws std::runtime_error when it is not well-formed.
inline std::unique_ptr<XmlElement> parse_xml(const std::string& text) {
  return detail::XmlReader(text).document();
}

}  // namespace hp::testing
